//! Length-aware audio batches end to end, through the library's `Loader`: clips of 1–12 s
//! (written by the dataset generator) planned from their declared lengths, decoded into batches
//! padded only to their longest clip, under the cap, every clip once per epoch across ranks
//! (equal batch counts), a corrupt clip skipped and counted, an interrupted epoch resumed
//! exactly; and the same from a pipeline file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flowgate::dataset::{Dataset, Source};
use flowgate::media::audio::{duration, AudioRecipe};
use flowgate::media::Recipe;
use flowgate::synth::{write_dataset, DatasetSpec};
use flowgate::Loader;

use crate::common;

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

/// A loader of rank `rank` of `world` over `paths` in length-aware batches (the library's
/// `Loader`, which pipeline files and Python build too).
fn loader(paths: &[PathBuf], rank: usize, world: usize) -> Loader {
    let recipe = Recipe::audio(AudioRecipe {
        samples: (CAP * RATE as f64) as usize,
        ..AudioRecipe::default()
    })
    .unwrap();
    let dataset = Dataset::builder(Source::files(paths.to_vec()))
        .shuffle(5)
        .ranks(rank, world)
        .build()
        .unwrap();
    Loader::builder(dataset, recipe)
        .length_batches(CAP, 6)
        .workers(2)
        .autotune_off()
        .build()
        .unwrap()
}

#[test]
fn the_memory_budget_holds_length_aware_batches_in_flight() {
    // No floor was checked or reserved for length-aware batches: a budget of 10 KiB ran
    // batches of 270 KB. Now: a batch is at most the cap's samples, padding
    // included, with its clips' lengths and labels.
    let paths = clips();
    let build = |bytes: u64| {
        let recipe = Recipe::audio(AudioRecipe {
            samples: (CAP * RATE as f64) as usize,
            ..AudioRecipe::default()
        })
        .unwrap();
        let dataset = Dataset::builder(Source::files(paths.clone()))
            .build()
            .unwrap();
        Loader::builder(dataset, recipe)
            .length_batches(CAP, 6)
            .workers(2)
            .memory_budget(bytes)
            .build()
    };
    let (mut lo, mut hi) = (1u64, 1 << 30);
    assert!(build(hi).is_ok());
    let e = build(lo).unwrap_err().to_string();
    assert!(e.contains("cannot hold a batch in flight"), "{e}");
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if build(mid).is_ok() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    // Four batches and one per decode worker and one waiting (2 workers): seven at the cap.
    let media = (CAP * RATE as f64) as u64 * 4;
    assert!(hi >= 7 * media && hi < 7 * (media + (1 << 20)), "{hi}");
    // At the smallest budget an epoch runs whole, a slow loop letting the stages fill, and
    // what they hold stays within it.
    let mut l = build(hi).unwrap();
    let (mut clips, mut peak) = (0, 0);
    let mut epoch = l.epoch().unwrap();
    while let Some(b) = epoch.next() {
        clips += b.unwrap().len();
        std::thread::sleep(std::time::Duration::from_millis(20));
        peak = peak.max(epoch.stats().bytes_held());
    }
    assert_eq!(clips, paths.len());
    assert!(peak <= hi, "held {peak} under a budget of {hi}");
}

/// A batch's rows (paths), padded samples and lengths.
fn rows(l: &Loader, b: &flowgate::loader::Batch) -> (Vec<String>, usize, Vec<i64>) {
    let t = b.fields[0].shape()[1];
    let flowgate::device::Delivered::Host(lengths) = &b.fields[1] else {
        panic!("a batch in host memory")
    };
    let lengths = lengths
        .bytes()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (b.items.iter().map(|m| l.path_of(m)).collect(), t, lengths)
}

#[test]
fn length_batches_cover_each_clip_under_the_cap_and_resume_exactly() {
    let mut paths = clips();
    let declared: BTreeMap<String, f64> = paths
        .iter()
        .map(|p| {
            let d = duration(p).unwrap().expect("FLAC declares its length");
            (p.display().to_string(), d)
        })
        .collect();
    assert!(
        declared.values().all(|&l| (0.9..12.1).contains(&l)),
        "{declared:?}"
    );
    // A corrupt clip: planned, then skipped and counted in its batch (not a failed run).
    let bad = paths[0].with_file_name("bad.flac");
    std::fs::write(&bad, b"fLaC but not really").unwrap();
    paths.insert(17, bad.clone());

    // Two ranks: equal batch counts, every clip at least once (padding repeats a few batches),
    // each batch under the cap and padded only to its longest clip.
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut counts = Vec::new();
    let mut failed = 0;
    let mut largest = 0;
    for rank in 0..2 {
        let mut l = loader(&paths, rank, 2);
        let batches: Vec<_> = l.epoch().unwrap().map(Result::unwrap).collect();
        for b in &batches {
            let (clips, t, lens) = rows(&l, b);
            assert_eq!(clips.len(), lens.len());
            largest = largest.max(clips.len() + 1);
            assert!(
                clips.len() as f64 * t as f64 <= CAP * RATE as f64 + 1.0,
                "over the cap"
            );
            assert_eq!(
                t as i64,
                *lens.iter().max().unwrap(),
                "padded to the longest only"
            );
            for (clip, len) in clips.iter().zip(&lens) {
                // Decoded lengths match the declared ones (to a sample).
                assert!(
                    (*len as f64 - declared[clip] * RATE as f64).abs() <= 1.0,
                    "{clip}"
                );
                *seen.entry(clip.clone()).or_default() += 1;
            }
        }
        counts.push(batches.len());
        let f = l.watch().failures(Some(0));
        assert!(
            f.iter().all(|f| f.item == bad.display().to_string()),
            "{f:?}"
        );
        failed += f.len();
        assert_eq!(l.stats().failures, f.len() as u64);
    }
    assert_eq!(counts[0], counts[1], "equal batch counts per rank");
    assert_eq!(seen.len(), declared.len(), "every good clip");
    assert!((1..=2).contains(&failed), "the bad clip counted ({failed})");
    // Padding repeats one batch at most (an odd count over two ranks).
    let repeats: usize = seen.values().map(|&c| c - 1).sum();
    assert!(repeats <= largest, "{repeats} repeated clips");

    // One rank, epoch 0 interrupted after 3 batches: a new loader resumed from the state
    // delivers exactly the rest.
    let good = clips();
    let mut first = loader(&good, 0, 1);
    let (taken, state) = common::take_then_save(&mut first, 3);
    drop(first);
    let rest = common::rest_after(&mut loader(&good, 0, 1), &state);
    let mut all = [taken, rest].concat();
    all.sort_unstable();
    assert_eq!(all, (0..good.len()).collect::<Vec<_>>(), "each clip once");
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
        for b in loader.epoch().unwrap() {
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
    let rows: usize = loader.epoch().unwrap().map(|b| b.unwrap().shape()[0]).sum();
    assert_eq!(rows, paths.len(), "every good clip, the bad one left out");
    let stats = loader.stats();
    assert_eq!(stats.failures, 1, "{:?}", stats.recent_failures);
    assert!(
        stats.recent_failures[0].contains("bad.flac"),
        "{:?}",
        stats.recent_failures
    );

    let spec = PipelineSpec::parse(&text("max_failures = 0\n"), "p.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    let err = loader
        .epoch()
        .unwrap()
        .find_map(Result::err)
        .expect("the bad clip stops the run");
    assert!(err.is_failure_budget(), "{err}");
    assert!(err.item().unwrap().ends_with("bad.flac"), "{err}");
}

/// Each row of a length-aware batch carries its file's label (and the loader its classes);
/// clips whose channels are kept cannot be padded by time and are refused when built.
#[test]
fn length_aware_rows_carry_their_files_labels_and_kept_channels_are_refused() {
    use flowgate::dataset::Labels;
    let paths = clips();
    let values: Vec<i64> = (0..paths.len() as i64).map(|i| 100 + i).collect();
    let dataset = Dataset::builder(Source::files(paths.clone()).labels(Labels::Values(values)))
        .shuffle(3)
        .build()
        .unwrap();
    let recipe = Recipe::audio(AudioRecipe {
        samples: (CAP * RATE as f64) as usize,
        ..AudioRecipe::default()
    })
    .unwrap();
    let mut l = Loader::builder(dataset.clone(), recipe)
        .length_batches(CAP, 6)
        .build()
        .unwrap();
    let mut seen = 0;
    for b in l.epoch().unwrap() {
        let b = b.unwrap();
        let labels = b.label_values().expect("labels on every row");
        for (m, label) in b.items.iter().zip(&labels) {
            assert_eq!(*label, 100 + m.index as i64);
        }
        assert!(b.labels.is_some());
        seen += b.len();
    }
    assert_eq!(seen, paths.len());
    let keep = Recipe::audio(AudioRecipe {
        channels: flowgate::media::audio::Channels::Keep,
        ..AudioRecipe::default()
    })
    .unwrap();
    let e = Loader::builder(dataset, keep)
        .length_batches(CAP, 6)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("mono"), "{e}");
}

/// A speech corpus as WebDataset shards: `KEY.flac` beside `KEY.txt` (the transcript, naming
/// its key) and `KEY.cls`; one sample whose audio is corrupt and one without its transcript.
/// Returns the shards' pattern and each good key's declared duration.
fn speech_shards(dir: &Path, faults: bool) -> (String, BTreeMap<String, f64>) {
    use flowgate::dataset::shards::tar::write_archive;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let paths = clips();
    let mut durations = BTreeMap::new();
    let mut samples: Vec<Vec<(String, Vec<u8>)>> = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        let key = format!("utt{i:04}");
        durations.insert(key.clone(), duration(p).unwrap().unwrap());
        samples.push(vec![
            (format!("{key}.flac"), std::fs::read(p).unwrap()),
            (format!("{key}.txt"), transcript(&key).into_bytes()),
            (format!("{key}.cls"), i.to_string().into_bytes()),
        ]);
    }
    if faults {
        let good = std::fs::read(&paths[0]).unwrap();
        // A real header (planned by its declared length), then zeros where the frames were.
        samples.insert(
            11,
            vec![
                ("bad.flac".into(), [&good[..200], &[0u8; 4000][..]].concat()),
                ("bad.txt".into(), transcript("bad").into_bytes()),
                ("bad.cls".into(), b"999".to_vec()),
            ],
        );
        samples.insert(
            23,
            vec![
                ("untold.flac".into(), good.clone()),
                ("untold.cls".into(), b"998".to_vec()),
            ],
        );
    }
    // Shards of 7 samples (the last shorter): 40 or 42 samples.
    for (s, chunk) in samples.chunks(7).enumerate() {
        let f = std::fs::File::create(dir.join(format!("speech-{s:02}.tar"))).unwrap();
        write_archive(std::io::BufWriter::new(f), chunk.concat()).unwrap();
    }
    let n = samples.len().div_ceil(7) - 1;
    (
        format!("{}/speech-{{00..{n:02}}}.tar", dir.display()),
        durations,
    )
}

fn transcript(key: &str) -> String {
    format!("the words of {key}, spoken")
}

/// A loader of rank `rank` of `world` over speech shards, transcripts as the field `text`.
fn speech_loader(pattern: &str, rank: usize, world: usize) -> Loader {
    use flowgate::dataset::{FieldSpec, Labels};
    let recipe = Recipe::audio(AudioRecipe {
        samples: (CAP * RATE as f64) as usize,
        ..AudioRecipe::default()
    })
    .unwrap();
    let source = Source::shards(pattern)
        .labels(Labels::Field("cls".into()))
        .extra_fields([FieldSpec::new("text", "txt")]);
    let dataset = Dataset::builder(source)
        .shuffle(11)
        .ranks(rank, world)
        .build()
        .unwrap();
    Loader::builder(dataset, recipe)
        .length_batches(CAP, 5)
        .workers(2)
        .autotune_off()
        .build()
        .unwrap()
}

/// Each row's key (from `SHARD:KEY`), transcript and real length.
fn speech_rows(l: &Loader, b: &flowgate::loader::Batch) -> Vec<(String, String, i64)> {
    let (names, t, lengths) = rows(l, b);
    assert_eq!(
        t as i64,
        *lengths.iter().max().unwrap(),
        "padded to the longest"
    );
    let texts = b.field("text").expect("the transcripts");
    names
        .iter()
        .zip(texts)
        .zip(lengths)
        .map(|((name, text), len)| {
            let key = name.rsplit(':').next().unwrap().to_owned();
            let flowgate::dataset::FieldValue::Text(text) = text else {
                panic!("{name}: a transcript, not {text:?}")
            };
            (key, text.clone(), len)
        })
        .collect()
}

/// Speech shards (FLAC + transcript) batched by audio length: each row's transcript and
/// label are its own clip's (its decoded length is the one its header declares), every good
/// clip once across 4 ranks (42 clips: not a multiple) with equal batch counts, the corrupt clip and the one without a
/// transcript left out of their batches and counted by name; an epoch interrupted mid-way
/// resumes to exactly the rest, still aligned.
#[test]
fn speech_shards_batch_by_length_with_each_transcript_beside_its_clip() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("speech-shards");
    let (pattern, durations) = speech_shards(&dir, true);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut counts = Vec::new();
    let mut failed = Vec::new();
    for rank in 0..4 {
        let mut l = speech_loader(&pattern, rank, 4);
        let batches: Vec<_> = l.epoch().unwrap().map(Result::unwrap).collect();
        for b in &batches {
            let labels = b.label_values().unwrap();
            for ((key, text, len), label) in speech_rows(&l, b).into_iter().zip(labels) {
                assert_eq!(text, transcript(&key), "the transcript of {key}");
                assert_eq!(format!("utt{label:04}"), key, "the label of {key}");
                let declared = durations[&key] * RATE as f64;
                assert!((len as f64 - declared).abs() <= 1.0, "{key}: {len} samples");
                *seen.entry(key).or_default() += 1;
            }
        }
        counts.push(batches.len());
        let f = l.watch().failures(Some(0));
        assert_eq!(l.stats().failures, f.len() as u64, "each counted");
        failed.extend(f.into_iter().map(|f| f.item));
    }
    assert!(
        counts.iter().all(|&c| c == counts[0]),
        "equal batch counts {counts:?}"
    );
    assert_eq!(seen.len(), durations.len(), "every good clip");
    failed.sort();
    failed.dedup();
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(failed.iter().any(|f| f.ends_with(":bad")), "{failed:?}");
    assert!(failed.iter().any(|f| f.ends_with(":untold")), "{failed:?}");

    // One rank, interrupted after 2 batches: the rest, exactly, with its transcripts.
    let (good, _) = speech_shards(&dir.join("good"), false);
    let mut first = speech_loader(&good, 0, 1);
    let (taken, state) = common::take_then_save(&mut first, 2);
    drop(first);
    let mut again = speech_loader(&good, 0, 1);
    again.resume(&state).unwrap();
    let mut rest = Vec::new();
    let batches: Vec<_> = again.epoch().unwrap().map(Result::unwrap).collect();
    for b in batches {
        for (key, text, _) in speech_rows(&again, &b) {
            assert_eq!(text, transcript(&key));
        }
        rest.extend(b.items.iter().map(|m| m.index));
    }
    let mut all = [taken.clone(), rest].concat();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..durations.len()).collect::<Vec<_>>(),
        "each clip once"
    );
    assert!(!taken.is_empty());
}

/// Length-aware batches plan from every clip before the first epoch: sources that cannot be
/// read that way are refused when built, naming what can.
#[test]
fn length_batches_refuse_a_mixture() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("speech-mix");
    let (pattern, _) = speech_shards(&dir, false);
    let recipe = Recipe::audio(AudioRecipe::default()).unwrap();
    let mix = Source::mix(
        [Source::shards(&pattern), Source::shards(&pattern)],
        [1.0, 2.0],
    );
    let dataset = Dataset::builder(mix).build().unwrap();
    let e = Loader::builder(dataset, recipe)
        .length_batches(CAP, 5)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("not S3 nor a mixture"), "{e}");
}

/// Loose clips with their transcripts beside them (`a.flac` + `a.txt`) in length-aware
/// batches: each row's transcript is its own file's.
#[test]
fn loose_clips_carry_the_transcripts_beside_them() {
    use flowgate::dataset::{FieldSpec, FieldValue};
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("speech-loose");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let paths = clips();
    for (i, p) in paths.iter().enumerate().take(13) {
        let key = format!("utt{i:04}");
        std::fs::copy(p, dir.join(format!("{key}.flac"))).unwrap();
        std::fs::write(dir.join(format!("{key}.txt")), transcript(&key)).unwrap();
    }
    let recipe = Recipe::audio(AudioRecipe {
        samples: (CAP * RATE as f64) as usize,
        ..AudioRecipe::default()
    })
    .unwrap();
    let source = Source::dir(&dir)
        .extensions(["flac"])
        .extra_fields([FieldSpec::new("text", "txt")]);
    let dataset = Dataset::builder(source).shuffle(2).build().unwrap();
    let mut l = Loader::builder(dataset, recipe)
        .length_batches(CAP, 3)
        .build()
        .unwrap();
    let batches: Vec<_> = l.epoch().unwrap().map(Result::unwrap).collect();
    let mut n = 0;
    for b in &batches {
        for (m, text) in b.items.iter().zip(b.field("text").unwrap()) {
            let path = l.path_of(m);
            let key = Path::new(&path).file_stem().unwrap().to_str().unwrap();
            assert_eq!(text, &FieldValue::Text(transcript(key)), "{path}");
            n += 1;
        }
    }
    assert_eq!(n, 13);
}

/// A FLAC whose header does not declare its length (`total_samples` 0, as streaming
/// encoders write) is a failed item of its batch, named, not a loader that refuses to build
/// (one such clip kept a whole corpus from loading).
#[test]
fn a_clip_that_declares_no_length_fails_in_its_batch_by_name() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("length-undeclared");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut paths: Vec<PathBuf> = clips().into_iter().take(9).collect();
    let mut flac = std::fs::read(&paths[0]).unwrap();
    // STREAMINFO's 36-bit sample count: the low bits of the big-endian u64 at byte 18.
    let mut word = u64::from_be_bytes(flac[18..26].try_into().unwrap());
    word &= !((1u64 << 36) - 1);
    flac[18..26].copy_from_slice(&word.to_be_bytes());
    let streamed = dir.join("streamed.flac");
    std::fs::write(&streamed, &flac).unwrap();
    assert_eq!(duration(&streamed).unwrap(), None, "no declared length");
    paths.push(streamed.clone());
    let mut l = loader(&paths, 0, 1);
    let rows: usize = l.epoch().unwrap().map(|b| b.unwrap().items.len()).sum();
    assert_eq!(rows, 9, "every other clip");
    let f = l.watch().failures(Some(0));
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].item, streamed.display().to_string());
    assert!(
        f[0].message.contains("does not declare its length"),
        "{f:?}"
    );
}
