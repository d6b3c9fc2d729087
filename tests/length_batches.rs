//! Length-aware audio batches end to end: clips of 1–12 s (written by the dataset generator)
//! planned from their declared lengths, decoded into batches padded only to their longest clip,
//! under the cap, every clip once per epoch across ranks (equal batch counts), and an
//! interrupted epoch resumed exactly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flowgate::media::audio::{duration, AudioRecipe};
use flowgate::media::synth::{write_dataset, DatasetSpec};
use flowgate::sampler::{Bucketing, LengthBatches, ShardLengths};
use flowgate::{Pipeline, Tensor};

const CAP: f64 = 30.0;
const RATE: usize = 16_000;

/// The test's clips, written once for both tests.
fn clips() -> Vec<PathBuf> {
    static CLIPS: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();
    CLIPS
        .get_or_init(|| {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("length-batches");
            let _ = std::fs::remove_dir_all(&dir);
            let out = write_dataset(&DatasetSpec {
                out: dir,
                images: 0,
                audio: 40,
                audio_seconds: (1.0, 12.0),
                ..DatasetSpec::default()
            })
            .unwrap();
            std::fs::read_to_string(out.join("audio.txt"))
                .unwrap()
                .lines()
                .map(PathBuf::from)
                .collect()
        })
        .clone()
}

/// Rank `rank` of `world`'s batches: (slot, rows, padded samples, lengths).
fn pipeline(
    plan: &Arc<LengthBatches>,
    paths: &Arc<Vec<PathBuf>>,
    rank: usize,
    world: usize,
) -> Pipeline<(usize, Tensor, Vec<i64>)> {
    let slots = plan
        .sampler()
        .shuffle(5)
        .shard(rank, world)
        .unwrap()
        .shard_lengths(ShardLengths::Pad);
    let (plan, paths) = (Arc::clone(plan), Arc::clone(paths));
    let recipe = AudioRecipe {
        samples: (CAP * RATE as f64) as usize,
        ..AudioRecipe::default()
    };
    Pipeline::builder()
        .source_sampled(slots, |epoch, slot| (epoch, slot))
        .checkpoint_fields(plan.fingerprint())
        .pipe(
            "decode",
            move |(epoch, slot): (u64, usize)| {
                let clips: Vec<PathBuf> = plan
                    .batch(epoch, slot)
                    .into_iter()
                    .map(|i| paths[i].clone())
                    .collect();
                match recipe.load_batch(&clips) {
                    (Some((batch, lengths)), errors) if errors.is_empty() => {
                        let lengths = lengths
                            .bytes()
                            .chunks_exact(8)
                            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                            .collect();
                        Ok((slot, batch, lengths))
                    }
                    (_, mut errors) => Err(errors.remove(0)),
                }
            },
            2,
        )
        .autotune_off()
        .build()
        .unwrap()
}

#[test]
fn length_batches_cover_each_clip_under_the_cap_and_resume_exactly() {
    let paths = clips();
    let lengths: Vec<f64> = paths
        .iter()
        .map(|p| duration(p).unwrap().expect("FLAC declares its length"))
        .collect();
    assert!(
        lengths.iter().all(|&l| (0.9..12.1).contains(&l)),
        "{lengths:?}"
    );
    let plan = Arc::new(
        LengthBatches::new(lengths.clone(), CAP, Bucketing::Quantiles(6))
            .unwrap()
            .shuffle(5),
    );
    let paths = Arc::new(paths);

    // Two ranks: equal batch counts, every clip at least once (padding repeats a few batches),
    // each batch under the cap and padded only to its longest clip.
    let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
    let mut counts = Vec::new();
    for rank in 0..2 {
        let mut p = pipeline(&plan, &paths, rank, 2);
        let mut n = 0;
        for b in p.iter() {
            let (slot, batch, lens) = b.unwrap();
            let (rows, t) = (batch.shape()[0], batch.shape()[1]);
            assert_eq!(rows, lens.len());
            assert!(
                rows as f64 * t as f64 <= CAP * RATE as f64 + 1.0,
                "over the cap"
            );
            assert_eq!(
                t as i64,
                *lens.iter().max().unwrap(),
                "padded to the longest only"
            );
            for (i, &clip) in plan.batch(0, slot).iter().enumerate() {
                // Decoded lengths match the declared ones (to a sample).
                assert!((lens[i] as f64 - lengths[clip] * RATE as f64).abs() <= 1.0);
                *seen.entry(clip).or_default() += 1;
            }
            n += 1;
        }
        counts.push(n);
    }
    assert_eq!(counts[0], counts[1], "equal batch counts per rank");
    assert_eq!(seen.len(), paths.len(), "every clip");
    // Padding repeats one batch at most (an odd count over two ranks).
    let repeats: usize = seen.values().map(|&c| c - 1).sum();
    let largest = (0..plan.len())
        .map(|s| plan.batch(0, s).len())
        .max()
        .unwrap();
    assert!(repeats <= largest, "{repeats} repeated clips");

    // One rank, epoch 0 interrupted after 3 batches: the resumed pipeline delivers exactly the
    // rest.
    let full: Vec<usize> = {
        let mut p = pipeline(&plan, &paths, 0, 1);
        p.iter().map(|b| b.unwrap().0).collect()
    };
    let mut p = pipeline(&plan, &paths, 0, 1);
    let first: Vec<usize> = p.iter().take(3).map(|b| b.unwrap().0).collect();
    let state = p.state();
    drop(p);
    let mut q = pipeline(&plan, &paths, 0, 1);
    q.resume(&state).unwrap();
    let rest: Vec<usize> = q.iter().map(|b| b.unwrap().0).collect();
    let mut all = [first, rest].concat();
    all.sort_unstable();
    let mut want = full;
    want.sort_unstable();
    assert_eq!(all, want, "the interrupted epoch's batches, each once");
}

#[test]
fn a_pipeline_file_asks_for_length_batches() {
    use flowgate::spec::{Hooks, PipelineSpec};
    let paths = clips();
    let dir = paths[0].parent().unwrap().parent().unwrap();
    let text = format!(
        "[source]\nkind = \"list\"\npath = \"{}\"\nshuffle = 3\n\
         [decode]\nkind = \"audio\"\n\
         [batch]\nmax_seconds = {CAP}\nbuckets = 6\n[run]\nepochs = 2\n",
        dir.join("audio.txt").display()
    );
    let spec = PipelineSpec::parse(&text, "p.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    assert_eq!(loader.items, paths.len());
    for _ in 0..2 {
        let mut rows = 0;
        for b in loader.pipeline.iter() {
            let b = b.unwrap();
            let (n, t) = (b.shape()[0], b.shape()[1]);
            assert!(n as f64 * t as f64 <= CAP * RATE as f64 + 1.0);
            rows += n;
        }
        assert_eq!(rows, paths.len(), "each clip once per epoch");
    }
    // Only for audio from files.
    let e = PipelineSpec::parse(
        &text.replace("kind = \"audio\"", "kind = \"image\""),
        "p.toml",
    )
    .unwrap_err();
    assert_eq!(e.key, "batch.max_seconds", "{e}");
}

/// A clip that declares a length and then fails to decode is left out of its batch as a
/// counted failure of the decode stage, named; with `run.max_failures = 0` it stops the run.
#[test]
fn a_clip_left_out_of_a_batch_is_counted_and_fatal_when_asked() {
    use flowgate::spec::{Hooks, PipelineSpec};
    let paths = clips();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("length-batches-bad");
    std::fs::create_dir_all(&dir).unwrap();
    // A real FLAC header (so it is planned), then zeros where its frames were.
    let bad = dir.join("bad.flac");
    let good = std::fs::read(&paths[0]).unwrap();
    std::fs::write(&bad, [&good[..200], &[0u8; 4000][..]].concat()).unwrap();
    let list = dir.join("list.txt");
    let mut lines: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    lines.push(bad.display().to_string());
    std::fs::write(&list, lines.join("\n")).unwrap();
    let text = |run: &str| {
        format!(
            "[source]\nkind = \"list\"\npath = \"{}\"\nshuffle = 3\n\
             [decode]\nkind = \"audio\"\n\
             [batch]\nmax_seconds = {CAP}\nbuckets = 4\n[run]\nepochs = 1\n{run}",
            list.display()
        )
    };
    let spec = PipelineSpec::parse(&text(""), "p.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    let rows: usize = loader.pipeline.iter().map(|b| b.unwrap().shape()[0]).sum();
    assert_eq!(rows, paths.len(), "every good clip, the bad one left out");
    let stats = loader.pipeline.stats();
    assert_eq!(stats.failures, 1, "{:?}", stats.recent_failures);
    assert!(
        stats.recent_failures[0].contains("bad.flac"),
        "{:?}",
        stats.recent_failures
    );

    let spec = PipelineSpec::parse(&text("max_failures = 0\n"), "p.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    let err = loader
        .pipeline
        .iter()
        .find_map(Result::err)
        .expect("the bad clip stops the run");
    assert!(err.is_failure_budget(), "{err}");
    assert!(err.item().unwrap().ends_with("bad.flac"), "{err}");
}
