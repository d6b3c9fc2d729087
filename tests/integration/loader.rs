//! The library's loader (`flowgate::Loader`), which the Rust API, pipeline files and Python
//! all build: every item once per epoch at every rank (counts not divisible by the ranks or
//! the batch size), exact resume and merge across world sizes, mixtures by weight with each
//! source's labels, failures skipped, counted and named (or fatal), and the device stage.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::dataset::{Dataset, Labels, Ranks, Source};
use flowgate::device::Delivered;
use flowgate::loader::Device;
use flowgate::sampler::MixStop;
use flowgate::{FailureBudget, Loader, PipelineState};

use crate::common;

/// Images per test set: a prime, so no rank count or batch size divides it.
const IMAGES: usize = 37;

use common::{epoch_items as epoch, small_recipe as recipe, tiny_jpeg as jpeg};

/// `IMAGES` JPEGs in three class folders (`a`, `b`, `c` by index modulo 3), and the same
/// images as tar shards of 10 (labels = index) and a Parquet file (labels = 1000 + index).
struct Data {
    dir: PathBuf,
    paths: Vec<PathBuf>,
    shards: String,
    parquet: PathBuf,
}

fn data() -> &'static Data {
    static DATA: OnceLock<Data> = OnceLock::new();
    DATA.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("loader");
        let _ = std::fs::remove_dir_all(&dir);
        let mut paths = Vec::new();
        for i in 0..IMAGES {
            let class = ["a", "b", "c"][i % 3];
            let p = dir.join("images").join(class).join(format!("{i:03}.jpg"));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, jpeg(i)).unwrap();
            paths.push(p);
        }
        let shards =
            flowgate::dataset::shards::write_shards(&paths, &dir.join("shards"), 10, |i, _| {
                i as i64
            })
            .unwrap();
        let parquet = dir.join("rows.parquet");
        flowgate::dataset::parquet::write_parquet(&paths, &parquet, 8, |i, _| 1000 + i as i64)
            .unwrap();
        Data {
            dir,
            paths,
            shards,
            parquet,
        }
    })
}

fn counts(items: &[(String, Option<i64>)]) -> BTreeMap<String, usize> {
    let mut c = BTreeMap::new();
    for (p, _) in items {
        *c.entry(p.clone()).or_default() += 1;
    }
    c
}

#[test]
fn every_item_once_per_epoch_at_every_rank_with_its_folder_label() {
    let d = data();
    for drop_last in [false, true] {
        let mut all = Vec::new();
        for rank in 0..3 {
            let dataset =
                Dataset::builder(Source::dir(d.dir.join("images")).labels(Labels::Folder))
                    .extensions(&["jpg"])
                    .shuffle(11)
                    .ranks(rank, 3)
                    .drop_last(drop_last)
                    .build()
                    .unwrap();
            let share = if drop_last {
                IMAGES / 3
            } else {
                IMAGES.div_ceil(3)
            };
            assert_eq!(dataset.len(), share);
            let mut loader = Loader::builder(dataset, recipe())
                .batch_size(5)
                .workers(2)
                .build()
                .unwrap();
            assert_eq!(loader.len(), share.div_ceil(5));
            assert_eq!(loader.classes().unwrap(), ["a", "b", "c"]);
            for e in 0..2 {
                let (items, sizes) = epoch(&mut loader);
                assert_eq!(items.len(), share, "rank {rank}, epoch {e}");
                assert_eq!(sizes.len(), share.div_ceil(5));
                assert!(
                    sizes[..sizes.len() - 1].iter().all(|&n| n == 5),
                    "{sizes:?}"
                );
                for (p, label) in &items {
                    let class = Path::new(p).parent().unwrap().file_name().unwrap();
                    let want = ["a", "b", "c"].iter().position(|c| *c == class).unwrap();
                    assert_eq!(*label, Some(want as i64), "{p}");
                }
                if e == 0 {
                    all.extend(items);
                }
            }
        }
        let c = counts(&all);
        let delivered: usize = c.values().sum();
        if drop_last {
            assert_eq!(c.len(), IMAGES - IMAGES % 3, "one item dropped per epoch");
            assert!(c.values().all(|&n| n == 1), "none twice");
        } else {
            assert_eq!(c.len(), IMAGES, "every item");
            assert_eq!(
                delivered - IMAGES,
                3 - IMAGES % 3,
                "only the padding repeats"
            );
        }
    }
}

#[test]
fn a_state_resumes_exactly_and_merged_states_resume_at_another_world_size() {
    let d = data();
    let build = |rank: usize, world: usize| {
        let dataset = Dataset::builder(Source::files(d.paths.clone()))
            .shuffle(3)
            .ranks_from(Ranks::Fixed { rank, world })
            .build()
            .unwrap();
        Loader::builder(dataset, recipe())
            .batch_size(4)
            .build()
            .unwrap()
    };
    // One process: 3 batches, a state, a new loader delivers exactly the rest.
    let mut first = build(0, 1);
    let (taken, state) = common::take_then_save(&mut first, 3);
    drop(first);
    let json = serde_json::to_string(&state).unwrap();
    let state: PipelineState = serde_json::from_str(&json).unwrap();
    let mut second = build(0, 1);
    second.resume(&state).unwrap();
    let (rest, _) = epoch(&mut second);
    assert_eq!(taken.len() + rest.len(), IMAGES);
    let mut all: Vec<String> = rest.into_iter().map(|(p, _)| p).collect();
    all.extend(taken.iter().map(|&i| d.paths[i].display().to_string()));
    assert_eq!(
        counts(&all.iter().map(|p| (p.clone(), None)).collect::<Vec<_>>()).len(),
        IMAGES
    );
    // The next epoch follows.
    let (next, _) = epoch(&mut second);
    assert_eq!(next.len(), IMAGES);

    // Three ranks take 2 batches each; their merged state resumes at two ranks.
    let mut before = Vec::new();
    let mut states = Vec::new();
    for rank in 0..3 {
        let mut l = build(rank, 3);
        let mut e = l.epoch().unwrap();
        for _ in 0..2 {
            let b = e.next().unwrap().unwrap();
            before.extend(
                b.items
                    .iter()
                    .map(|m| d.paths[m.index].display().to_string()),
            );
        }
        states.push(e.state().unwrap());
    }
    let merged = PipelineState::merge(&states).unwrap();
    let mut after = Vec::new();
    for rank in 0..2 {
        let mut l = build(rank, 2);
        l.resume(&merged).unwrap();
        after.extend(epoch(&mut l).0.into_iter().map(|(p, _)| p));
    }
    let all: Vec<(String, Option<i64>)> =
        before.into_iter().chain(after).map(|p| (p, None)).collect();
    let c = counts(&all);
    assert_eq!(c.len(), IMAGES, "every item of the epoch");
    let repeats: usize = c.values().map(|n| n - 1).sum();
    // Padding: at most world - 1 positions per world (3, then 2).
    assert!(repeats <= 2 + 1, "{repeats} repeated items");
}

#[test]
fn a_mixture_draws_by_weight_and_keeps_each_sources_labels() {
    let d = data();
    let mix = |stop: MixStop| {
        Source::mix(
            [
                Source::shards(d.shards.clone()).labels(Labels::Field("CLS".into())),
                Source::parquet([&d.parquet], "image").labels(Labels::Field("label".into())),
            ],
            [3.0, 1.0],
        )
        .stop(stop)
    };
    let dataset = Dataset::builder(mix(MixStop::Draws(400)))
        .shuffle(5)
        .build()
        .unwrap();
    let mut loader = Loader::builder(dataset, recipe())
        .batch_size(16)
        .build()
        .unwrap();
    let (items, _) = epoch(&mut loader);
    assert_eq!(items.len(), 400);
    let from_parquet = items.iter().filter(|(_, l)| l.unwrap() >= 1000).count();
    // 100 expected; a binomial's sd is ~8.7.
    assert!(
        (65..=135).contains(&from_parquet),
        "{from_parquet} of 400 from Parquet"
    );
    for (name, label) in &items {
        let label = label.unwrap();
        if name.contains(".tar:") {
            // SHARD:KEY, KEY = the image's index (write_shards names samples by index).
            let key: usize = name.rsplit(':').next().unwrap().parse().unwrap();
            assert_eq!(label, key as i64, "{name}");
        } else {
            assert!(label >= 1000, "{name}: {label}");
        }
    }
    // Until the first source runs out: no item twice.
    let dataset = Dataset::builder(mix(MixStop::FirstExhausted))
        .shuffle(5)
        .build()
        .unwrap();
    let mut loader = Loader::builder(dataset, recipe())
        .batch_size(7)
        .build()
        .unwrap();
    let (items, _) = epoch(&mut loader);
    assert!(counts(&items).values().all(|&n| n == 1));
    // Sources of which only some have labels are refused; so is a mixture of S3 shards.
    let half = Source::mix(
        [
            Source::shards(d.shards.clone()),
            Source::parquet([&d.parquet], "image").labels(Labels::Field("label".into())),
        ],
        [1.0, 1.0],
    );
    let e = Dataset::builder(half).build().unwrap_err();
    assert!(e.to_string().contains("label field, or none"), "{e}");
    // Each Parquet source has its own row-group cache: the budget reserves their sum.
    let one = Dataset::builder(Source::parquet([&d.parquet], "image"))
        .build()
        .unwrap()
        .reserved_bytes();
    let two = Dataset::builder(Source::mix(
        [
            Source::parquet([&d.parquet], "image"),
            Source::parquet([&d.parquet], "image"),
        ],
        [1.0, 1.0],
    ))
    .build()
    .unwrap()
    .reserved_bytes();
    assert!(one > 0);
    assert_eq!(two, 2 * one);
}

#[test]
fn a_bad_file_is_skipped_counted_and_named_or_fatal_when_asked() {
    let d = data();
    let bad = d.dir.join("bad.jpg");
    std::fs::write(&bad, b"not a jpeg at all").unwrap();
    let mut paths = d.paths[..20].to_vec();
    paths.insert(7, bad.clone());
    let build = |budget: FailureBudget| {
        let dataset = Dataset::builder(Source::files(paths.clone()))
            .build()
            .unwrap();
        Loader::builder(dataset, recipe())
            .batch_size(6)
            .max_failures(budget)
            .build()
            .unwrap()
    };
    let mut skip = build(FailureBudget::unlimited());
    let (items, _) = epoch(&mut skip);
    assert_eq!(items.len(), 20);
    assert_eq!(skip.stats().failures, 1);
    let failures = skip.watch().failures(Some(0));
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0].item, bad.display().to_string());
    assert_eq!(failures[0].stage, "decode");

    let mut strict = build(FailureBudget::fail_fast());
    let err = strict
        .epoch()
        .unwrap()
        .find_map(Result::err)
        .expect("the bad file ends the epoch");
    assert!(err.is_failure_budget(), "{err}");
    assert_eq!(err.item(), Some(bad.display().to_string().as_str()));
    // The epoch is over: the next is epoch 1, from its start, and a checkpoint says so.
    assert_eq!(strict.next_epoch(), 1);
    assert_eq!(strict.abandoned_epoch(), None);
    let state = strict.state().unwrap();
    assert_eq!((state.epoch, state.delivered_items), (1, 0));
}

#[test]
fn a_device_budget_below_one_batch_is_refused_when_built() {
    // It let one batch through at a time, over the budget.
    let d = data();
    let dataset = || {
        Dataset::builder(Source::shards(d.shards.clone()))
            .build()
            .unwrap()
    };
    let batch = recipe().item_bytes().unwrap() * 8;
    let device = |bytes| {
        Device::simulated(25e9, std::time::Duration::from_micros(5)).max_device_bytes(bytes)
    };
    let e = Loader::builder(dataset(), recipe())
        .batch_size(8)
        .device(device(batch - 1))
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("cannot hold one batch of {batch} bytes")),
        "{e}"
    );
    Loader::builder(dataset(), recipe())
        .batch_size(8)
        .device(device(batch))
        .build()
        .unwrap();
}

#[test]
fn labels_and_fields_travel_to_the_device() {
    let d = data();
    let dataset =
        Dataset::builder(Source::shards(d.shards.clone()).labels(Labels::Field("cls".into())))
            .build()
            .unwrap();
    let device = Device::simulated(25e9, std::time::Duration::from_micros(5));
    let mut loader = Loader::builder(dataset, recipe())
        .batch_size(8)
        .device(device)
        .build()
        .unwrap();
    let mut n = 0;
    for b in loader.epoch().unwrap() {
        let b = b.unwrap();
        assert!(matches!(b.fields[0], Delivered::Device(_)));
        let labels = b.labels.expect("labels");
        assert!(matches!(labels, Delivered::Device(_)));
        let host = labels.into_host().unwrap();
        let values: Vec<i64> = host
            .bytes()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(
            Some(values),
            b.items.iter().map(|m| m.label).collect::<Option<Vec<_>>>()
        );
        n += b.items.len();
    }
    assert_eq!(n, IMAGES);
    assert!(loader.sim_log().unwrap().records().len() >= 2 * IMAGES.div_ceil(8));
}

/// A large JPEG: slower to decode than its neighbours, so a completion-order pipeline would
/// let them overtake it.
fn slow_jpeg(shade: usize) -> Vec<u8> {
    let (w, h) = (480, 360);
    let pixels: Vec<u8> = (0..w * h * 3)
        .map(|i| ((i * 31 + shade) % 251) as u8)
        .collect();
    let mut out = Vec::new();
    jpeg_encoder::Encoder::new(&mut out, 95)
        .encode(&pixels, w as u16, h as u16, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

#[test]
fn the_same_seed_gives_the_same_batches_in_the_same_order() {
    let d = data();
    // Every 4th image is slow to decode.
    let dir = d.dir.join("uneven");
    let mut paths = Vec::new();
    for (i, p) in d.paths.iter().enumerate() {
        let q = dir.join(p.file_name().unwrap());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&q, if i % 4 == 0 { slow_jpeg(i) } else { jpeg(i) }).unwrap();
        paths.push(q);
    }
    let run = |seed: Option<u64>| {
        let dataset = Dataset::builder(Source::files(paths.clone()))
            .shuffle_seed(seed)
            .build()
            .unwrap();
        let mut l = Loader::builder(dataset, recipe())
            .batch_size(5)
            .workers(2)
            .build()
            .unwrap();
        let mut out = Vec::new();
        for _ in 0..2 {
            for b in l.epoch().unwrap() {
                let b = b.unwrap();
                let pixels = match &b.fields[0] {
                    Delivered::Host(t) => t.bytes().to_vec(),
                    Delivered::Device(_) => unreachable!("no device"),
                };
                out.push((b.items.iter().map(|m| m.index).collect::<Vec<_>>(), pixels));
            }
        }
        out
    };
    let (a, b) = (run(Some(9)), run(Some(9)));
    assert_eq!(
        a, b,
        "the same batches, in the same order, epoch after epoch"
    );
    assert_ne!(a[..8], a[8..], "a new order in the next epoch");
    // No shuffle: the dataset's own order.
    let plain: Vec<usize> = run(None)[..8].iter().flat_map(|(i, _)| i.clone()).collect();
    assert_eq!(plain, (0..IMAGES).collect::<Vec<_>>());
}

#[test]
fn an_epoch_in_which_every_item_fails_is_an_error_not_an_empty_epoch() {
    let d = data();
    // A label field no sample has: every sample fails for the same reason.
    let dataset =
        Dataset::builder(Source::shards(d.shards.clone()).labels(Labels::Field("cat".into())))
            .build()
            .unwrap();
    let mut loader = Loader::builder(dataset, recipe())
        .batch_size(8)
        .build()
        .unwrap();
    for epoch in 0..2 {
        let results: Vec<_> = loader.epoch().unwrap().collect();
        assert_eq!(results.len(), 1, "epoch {epoch}: one error, no batch");
        let e = results.into_iter().next().unwrap().unwrap_err();
        assert!(e.is_nothing_delivered(), "{e}");
        assert!(
            e.to_string()
                .contains(&format!("epoch {epoch} delivered nothing")),
            "{e}"
        );
        assert!(e.to_string().contains("no field cat"), "{e}");
    }
    // One good item is enough for an epoch to be an epoch.
    let bad = d.dir.join("bad.jpg");
    std::fs::write(&bad, b"not a jpeg at all").unwrap();
    let dataset = Dataset::builder(Source::files([bad.clone(), d.paths[0].clone()]))
        .build()
        .unwrap();
    let mut loader = Loader::builder(dataset, recipe()).build().unwrap();
    let got: Vec<_> = loader.epoch().unwrap().map(Result::unwrap).collect();
    assert_eq!(got.len(), 1);
}

/// Bytes this process has read through system calls (`rchar` of `/proc/self/io`).
fn bytes_read() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A tar sample's fields that are neither its media nor its label are not read at all: a
/// 48 MiB side file beside each 1 KiB image costs no I/O and no memory.
#[test]
fn a_samples_unused_fields_are_not_read() {
    let dir = std::env::temp_dir().join(format!("flowgate-unused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let big = vec![7u8; 48 << 20];
    let members: Vec<(String, Vec<u8>)> = (0..3)
        .flat_map(|i| {
            [
                (format!("s{i}.bin"), big.clone()),
                (format!("s{i}.jpg"), jpeg(i)),
                (format!("s{i}.cls"), i.to_string().into_bytes()),
            ]
        })
        .collect();
    let mut tar = Vec::new();
    flowgate::dataset::shards::tar::write_archive(&mut tar, members).unwrap();
    let shard = dir.join("shard-0.tar");
    std::fs::write(&shard, tar).unwrap();
    drop(big);
    let dataset = Dataset::builder(
        Source::shards(shard.display().to_string()).labels(Labels::Field("cls".into())),
    )
    .ranks_from(Ranks::Whole)
    .build()
    .unwrap();
    let before = bytes_read();
    let items: Vec<_> = (0..3).map(|i| dataset.read(i, 0).unwrap()).collect();
    let read = bytes_read() - before;
    assert_eq!(
        items.iter().map(|x| x.label).collect::<Vec<_>>(),
        [Some(0), Some(1), Some(2)]
    );
    assert!(read < 1 << 20, "{read} bytes read for three 1-KiB images");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn folder_labels_of_a_directory_are_image_folders_classes() {
    use flowgate::dataset::{Dataset, Labels, Source};
    let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("image-folder");
    let _ = std::fs::remove_dir_all(&root);
    let put = |rel: &str| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, common::tiny_jpeg(rel.len())).unwrap();
    };
    // cat holds files only in nested folders; a file at the root belongs to no class.
    for rel in [
        "cat/sub1/a.jpg",
        "cat/sub2/b.jpg",
        "dog/c.jpg",
        "dog/d.jpg",
        "root.jpg",
    ] {
        put(rel);
    }
    let open = || {
        Dataset::builder(Source::dir(&root).labels(Labels::Folder))
            .extensions(&["jpg"])
            .build()
    };
    let d = open().unwrap();
    assert_eq!(d.classes().unwrap(), ["cat", "dog"]);
    assert_eq!(d.len(), 4, "the root's file is left out");
    let mut by_class = std::collections::BTreeMap::new();
    for i in 0..d.len() {
        let name = d.name(i, 0);
        let label = d.read(i, 0).unwrap().label.unwrap();
        by_class.insert(name.rsplit('/').next().unwrap().to_owned(), label);
    }
    let want: std::collections::BTreeMap<String, i64> =
        [("a.jpg", 0), ("b.jpg", 0), ("c.jpg", 1), ("d.jpg", 1)]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
    assert_eq!(by_class, want);
    // An empty class folder is an error naming it, as ImageFolder raises.
    std::fs::create_dir_all(root.join("ant")).unwrap();
    let e = open().unwrap_err().to_string();
    assert!(e.contains("Found no valid file for the classes ant"), "{e}");
}
