//! WebDataset tar shards read by several ranks: every sample once per epoch, equal batch
//! counts, shard-level shuffles that repeat for a seed, exact (chained and elastic) resume
//! that reads nothing it skips, and damaged shards that fail naming shard and key.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use flowgate::dataset::shards::tar::write_archive;
use flowgate::dataset::shards::Shards;
use flowgate::media::image::ImageRecipe;
use flowgate::media::Recipe;
use flowgate::sample::FieldMap;
use flowgate::sample::{Field, Sample};
use flowgate::sampler::ShareLengths;
use flowgate::{FailureBudget, Order, Pipeline, PipelineState, Workers};

const SHARDS: usize = 64;
const BATCH: usize = 32;

fn jpeg(shade: u8) -> Vec<u8> {
    let mut out = Vec::new();
    let pixels: Vec<u8> = (0..8 * 8 * 3)
        .map(|i| shade.wrapping_add(i as u8))
        .collect();
    jpeg_encoder::Encoder::new(&mut out, 90)
        .encode(&pixels, 8, 8, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

/// 64 shards of 90 or 110 samples (6,400 in all): `KEY.jpg`, `KEY.cls` (the sample's global
/// number) and `KEY.json`. Returns the brace pattern.
fn corpus(dir: &Path) -> String {
    let mut id = 0u64;
    for s in 0..SHARDS {
        let n = if s % 2 == 0 { 90 } else { 110 };
        let mut members = Vec::new();
        for _ in 0..n {
            let key = format!("{id:08}");
            members.push((format!("{key}.jpg"), jpeg(id as u8)));
            members.push((format!("{key}.cls"), id.to_string().into_bytes()));
            members.push((
                format!("{key}.json"),
                format!("{{\"key\":\"{key}\"}}").into_bytes(),
            ));
            id += 1;
        }
        let f = std::fs::File::create(dir.join(format!("shard-{s:06}.tar"))).unwrap();
        write_archive(std::io::BufWriter::new(f), members).unwrap();
    }
    format!("{}/shard-{{000000..{:06}}}.tar", dir.display(), SHARDS - 1)
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flowgate-shards-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fields() -> FieldMap {
    let recipe = Recipe::image(ImageRecipe {
        resize: 8,
        crop: 8,
        ..ImageRecipe::default()
    })
    .unwrap();
    FieldMap::new()
        .decode("image", &["jpg", "png"], recipe)
        .label("label", "cls")
        .text("meta", "json")
}

fn label(s: &Sample) -> u64 {
    match s.get("label") {
        Some(Field::Label(v)) => *v as u64,
        other => panic!("no label: {other:?}"),
    }
}

/// A rank's pipeline: batches of 32 sample numbers, in input order. `reads` counts the
/// samples read from the shards.
fn build(shards: &Shards, reads: Arc<AtomicUsize>) -> Pipeline<Vec<u64>> {
    let fields = fields();
    Pipeline::builder()
        .source_sampled(shards.sampler().clone(), shards.refs())
        .checkpoint_fields(shards.fingerprint())
        .describe(|r| r.to_string())
        .pipe(
            "decode",
            move |r| {
                reads.fetch_add(1, Ordering::Relaxed);
                let s = fields.read(&r)?;
                assert_eq!(s.get("image").map(|_| ()), Some(()));
                Ok::<_, flowgate::dataset::shards::ShardError>(label(&s))
            },
            Workers::fixed(2),
        )
        .budget(16, u64::MAX)
        .output_order(Order::Input)
        .aggregate(BATCH, false)
        .build()
        .unwrap()
}

/// Fails naming how many samples are missing or repeated (not printing them all).
fn assert_exactly_once(ids: &[u64], n: usize) {
    let mut count = BTreeMap::new();
    for &i in ids {
        *count.entry(i).or_insert(0usize) += 1;
    }
    let twice = count.values().filter(|&&c| c > 1).count();
    let missing = n - count.len();
    assert!(
        twice == 0 && missing == 0 && ids.len() == n,
        "{} samples: {missing} missing, {twice} more than once",
        ids.len()
    );
}

fn epoch(p: &mut Pipeline<Vec<u64>>) -> Vec<Vec<u64>> {
    p.iter().map(Result::unwrap).collect()
}

fn open(pattern: &str, rank: usize, world: usize, seed: u64) -> Shards {
    Shards::open(pattern)
        .unwrap()
        .shuffle(seed)
        .buffer(64)
        .shard(rank, world)
        .unwrap()
}

#[test]
fn four_ranks_read_every_sample_once_with_equal_batches() {
    let dir = tmp("ranks");
    let pattern = corpus(&dir);
    let shard_of = |id: u64| -> usize {
        // Even shards hold 90 samples, odd ones 110: a pair holds 200.
        let (pair, rest) = ((id / 200) as usize, id % 200);
        pair * 2 + usize::from(rest >= 90)
    };
    let mut orders: BTreeMap<(usize, u64), Vec<u64>> = BTreeMap::new();
    for e in 0..2u64 {
        let mut seen = BTreeSet::new();
        let mut touches = 0;
        for rank in 0..4 {
            let shards = open(&pattern, rank, 4, 7);
            assert_eq!(shards.len(), 6400);
            let mut p = build(&shards, Arc::default());
            if e > 0 {
                p.start_at_epoch(e).unwrap();
            }
            let batches = epoch(&mut p);
            assert_eq!(
                batches.len(),
                6400 / 4 / BATCH,
                "rank {rank}: equal batches"
            );
            assert!(batches.iter().all(|b| b.len() == BATCH));
            let ids: Vec<u64> = batches.concat();
            for &id in &ids {
                assert!(seen.insert(id), "sample {id} twice in epoch {e}");
            }
            let mut mine: Vec<usize> = ids.iter().map(|&i| shard_of(i)).collect();
            mine.sort_unstable();
            mine.dedup();
            touches += mine.len();
            orders.insert((rank, e), ids);
        }
        assert_eq!(seen.len(), 6400, "every sample once in epoch {e}");
        // Each rank streams whole shards: only the shards at block edges are shared.
        assert!(touches <= SHARDS + 3, "{touches} shard reads for 64 shards");
    }
    assert_ne!(orders[&(0, 0)], orders[&(0, 1)], "a new order every epoch");
    // The same seed repeats the order; another seed does not.
    let again = epoch(&mut build(&open(&pattern, 0, 4, 7), Arc::default())).concat();
    assert_eq!(again, orders[&(0, 0)]);
    let other = epoch(&mut build(&open(&pattern, 0, 4, 8), Arc::default())).concat();
    assert_ne!(other, orders[&(0, 0)]);
    // The buffer mixes within a rank's stream: consecutive samples are not in key order.
    let o = &orders[&(1, 0)];
    let in_order = o.windows(2).filter(|w| w[1] == w[0] + 1).count();
    assert!(
        in_order < o.len() / 4,
        "{in_order} of {} in stream order",
        o.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mid_shard_checkpoints_resume_exactly_reading_only_what_is_left() {
    let dir = tmp("resume");
    let pattern = corpus(&dir);
    let shards = open(&pattern, 1, 2, 3);
    let whole: Vec<u64> = epoch(&mut build(&shards, Arc::default())).concat();
    assert_eq!(whole.len(), 3200);

    // Chained: stop after a few batches, resume, stop again, resume, finish.
    let mut got: Vec<u64> = Vec::new();
    let mut state: Option<PipelineState> = None;
    for stop_after in [7usize, 23, 41, usize::MAX] {
        let reads = Arc::new(AtomicUsize::new(0));
        let mut p = build(&shards, Arc::clone(&reads));
        if let Some(s) = &state {
            p.resume(s).unwrap();
        }
        let mut delivered = 0;
        for b in p.iter().take(stop_after) {
            let b = b.unwrap();
            delivered += b.len();
            got.extend(b);
        }
        if stop_after == usize::MAX {
            // The last leg read exactly what it delivered: nothing skipped was read.
            assert_eq!(reads.load(Ordering::Relaxed), delivered);
        }
        state = Some(p.state());
    }
    assert_exactly_once(&got, 3200);
    assert!(got == whole, "chained resumes give the epoch in its order");

    // Elastic: two ranks stop mid-shard; their merged state resumes at three ranks.
    let mut states = Vec::new();
    let mut before = Vec::new();
    for (rank, k) in [(0usize, 11usize), (1, 30)] {
        let mut p = build(&open(&pattern, rank, 2, 3), Arc::default());
        let b: Vec<Vec<u64>> = p.iter().take(k).map(Result::unwrap).collect();
        before.extend(b.concat());
        states.push(p.state());
    }
    let merged = PipelineState::merge(&states).unwrap();
    let mut after = Vec::new();
    for rank in 0..3 {
        let reads = Arc::new(AtomicUsize::new(0));
        let mut p = build(&open(&pattern, rank, 3, 3), Arc::clone(&reads));
        p.resume(&merged).unwrap();
        let ids = epoch(&mut p).concat();
        assert_eq!(reads.load(Ordering::Relaxed), ids.len());
        after.extend(ids);
    }
    let mut all = before;
    all.extend(after);
    assert_exactly_once(&all, 6400);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn padded_shares_are_equal_when_the_corpus_does_not_divide() {
    let dir = tmp("pad");
    let pattern = corpus(&dir);
    let mut seen = BTreeSet::new();
    for rank in 0..3 {
        let s = open(&pattern, rank, 3, 1).shard_lengths(ShareLengths::Pad);
        let ids = epoch(&mut build(&s, Arc::default())).concat();
        assert_eq!(ids.len(), 2134, "ceil(6400 / 3)");
        seen.extend(ids);
    }
    assert_eq!(seen.len(), 6400);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn damaged_shards_fail_naming_shard_and_key_and_the_rest_is_read() {
    let dir = tmp("bad");
    let m = |n: &str, d: Vec<u8>| (n.to_string(), d);
    let sample = |k: usize| {
        vec![
            m(&format!("{k:04}.jpg"), jpeg(k as u8)),
            m(&format!("{k:04}.cls"), k.to_string().into_bytes()),
        ]
    };
    let write = |name: &str, members: Vec<(String, Vec<u8>)>| {
        let mut v = Vec::new();
        write_archive(&mut v, members).unwrap();
        std::fs::write(dir.join(name), &v).unwrap();
        v
    };
    write("good.tar", (0..10).flat_map(sample).collect());
    let t = write("truncated.tar", (10..20).flat_map(sample).collect());
    std::fs::write(dir.join("truncated.tar"), &t[..t.len() / 2]).unwrap();
    std::fs::write(dir.join("garbage.tar"), vec![0x5a; 5000]).unwrap();
    std::fs::write(dir.join("empty.tar"), b"").unwrap();
    // A member declaring 2 GiB (over the 1 GiB limit) in a 3 KB file.
    let mut huge = write("huge.tar", (20..22).flat_map(sample).collect());
    huge[124..136].copy_from_slice(format!("{:011o}\0", 2u64 << 30).as_bytes());
    huge[148..156].fill(b' ');
    let sum: u64 = huge[..512].iter().map(|&x| x as u64).sum();
    huge[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    std::fs::write(dir.join("huge.tar"), &huge).unwrap();
    let mut odd = vec![m("0100.jpg", jpeg(1))]; // no cls
    odd.extend([
        m("0101.jpg", b"not a jpeg".to_vec()),
        m("0101.cls", b"1".to_vec()),
    ]);
    odd.extend([m("0102.jpg", jpeg(2)), m("0102.cls", b"seven".to_vec())]);
    odd.extend(sample(103));
    write("odd.tar", odd);

    let names = ["good", "truncated", "garbage", "empty", "huge", "odd"];
    let paths: Vec<PathBuf> = names.iter().map(|n| dir.join(format!("{n}.tar"))).collect();
    let shards = Shards::open_paths(paths.clone()).unwrap();
    assert_eq!(shards.damage().len(), 4, "{:?}", shards.damage());

    let failures = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = Arc::clone(&failures);
    let fields = FieldMap::new()
        .decode(
            "image",
            &["jpg"],
            Recipe::image(ImageRecipe {
                resize: 8,
                crop: 8,
                ..ImageRecipe::default()
            })
            .unwrap(),
        )
        .label("label", "cls");
    let make = |budget: FailureBudget| {
        let fields = fields.clone();
        let seen = Arc::clone(&seen);
        Pipeline::builder()
            .source_sampled(shards.sampler().clone(), shards.refs())
            .describe(|r| r.to_string())
            .pipe("decode", move |r| fields.read(&r), 2)
            .max_failures(budget)
            .on_failure(move |e| seen.lock().push(e.to_string()))
            .build()
            .unwrap()
    };
    let mut p = make(FailureBudget::unlimited());
    let labels: BTreeSet<u64> = p.iter().map(|s| label(&s.unwrap())).collect();
    // The good shard, the truncated shard's samples before the cut, and odd's last sample.
    assert!(labels.is_superset(&(0..10).collect()));
    assert!(labels.contains(&103));
    assert!(labels.iter().any(|&l| (10..20).contains(&l)), "{labels:?}");
    assert_eq!(p.stats().failures, 4 + 3);
    let got = failures.lock().join("\n");
    for says in [
        "truncated.tar, sample 0015: truncated",
        "garbage.tar, sample @byte 0: byte 0: not a tar header",
        "empty.tar, sample @byte 0: the shard holds no samples",
        "huge.tar, sample 0020: member \"0020.jpg\" at byte 0 declares 2147483648 bytes, over the limit",
        "odd.tar, sample 0100: no field cls (it has: jpg)",
        "odd.tar/0101.jpg",
        "odd.tar, sample 0102, field cls: \"seven\" is not an integer label",
    ] {
        assert!(got.contains(says), "no failure says {says:?}:\n{got}");
    }
    drop(p);

    // Fail-fast: the first damaged sample stops the epoch with an error naming it.
    let mut p = make(FailureBudget::fail_fast());
    let err = p
        .iter()
        .find_map(Result::err)
        .expect("a fail-fast epoch over damaged shards fails");
    assert!(err.to_string().contains(".tar"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_shards_and_bad_patterns_are_errors() {
    let e = Shards::open("/nonexistent/shard-{000..003}.tar").unwrap_err();
    assert!(e.to_string().contains("/nonexistent/shard-000.tar"), "{e}");
    assert!(Shards::open("x-{5..1}.tar").is_err());
    // Shards on S3 are tested against a real server in tests/integration/s3.rs; without the feature,
    // the URL is refused naming it.
    #[cfg(not(feature = "s3"))]
    {
        let e = Shards::open("s3://bucket/shard-0.tar").unwrap_err();
        assert!(e.to_string().contains("`s3` feature"), "{e}");
    }
    let e = Shards::open_paths(["s3://bucket/shard-0.tar"]).unwrap_err();
    assert!(
        e.to_string().contains("an s3:// URL among local paths"),
        "{e}"
    );
}
