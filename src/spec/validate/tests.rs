//! The checks of pipeline files: every error names its key and line.

use super::*;
use flowgate_actors::node::CpuBudget;

const GOOD: &str = r#"
[source]
kind = "list"
path = "images.txt"

[decode]
kind = "image"
resize = 256
crop = 224

[batch]
size = 16
"#;

#[test]
fn a_good_file_parses_with_defaults() {
    let s = PipelineSpec::parse(GOOD, "p.toml").unwrap();
    assert_eq!(s.batch_size(), 16);
    assert_eq!(s.run.epochs, 1);
    assert!(s.tuner.enabled);
}

#[test]
fn defaults_are_the_librarys_for_the_media() {
    let image = PipelineSpec::parse(&GOOD.replace("[batch]\nsize = 16\n", ""), "p.toml").unwrap();
    assert_eq!(image.batch_size(), crate::loader::DEFAULT_BATCH_SIZE);
    let video = "[source]\nkind = \"list\"\npath = \"v.txt\"\n[decode]\nkind = \"video\"\n";
    match PipelineSpec::parse(video, "p.toml") {
        Ok(v) => assert_eq!(v.batch_size(), crate::loader::DEFAULT_VIDEO_BATCH_SIZE),
        // Built without the video feature, the file is refused naming it.
        Err(e) => assert!(e.to_string().contains("video"), "{e}"),
    }
    let s3 = "[source]\nkind = \"s3\"\nbucket = \"b\"\n[decode]\nkind = \"image\"\n";
    let spec = PipelineSpec::parse(s3, "p.toml");
    if let Ok(spec) = spec {
        match spec.source {
            SourceSpec::S3 { concurrency, .. } => {
                assert_eq!(concurrency, crate::dataset::DEFAULT_FETCH_CONCURRENCY)
            }
            other => panic!("{other:?}"),
        }
    }
}

fn error(text: &str) -> SpecError {
    PipelineSpec::parse(text, "p.toml").unwrap_err()
}

#[test]
fn relative_paths_are_the_files() {
    let text = "[source]\nkind = \"mix\"\nweights = [1, 1, 1]\n\
                [[source.sources]]\nkind = \"list\"\npath = \"images.txt\"\n\
                [[source.sources]]\nkind = \"tar\"\n\
                shards = \"a/s-{0..1}.tar, /abs/b.tar,s3://bucket/c.tar\"\n\
                [[source.sources]]\nkind = \"parquet\"\npath = \"s3://bucket/p.parquet\"\n\
                [decode]\nkind = \"image\"\n[batch]\nsize = 4\n\
                [tuner]\ntrace = \"trace.jsonl\"\n";
    let mut s = PipelineSpec::parse(text, "p.toml").unwrap();
    s.relative_to(Path::new("/cfg"));
    let SourceSpec::Mix { sources, .. } = &s.source else {
        panic!("a mix")
    };
    match (&sources[0], &sources[1], &sources[2]) {
        (
            SourceSpec::List { path, .. },
            SourceSpec::Tar { shards, .. },
            SourceSpec::Parquet { path: p, .. },
        ) => {
            assert_eq!(path, Path::new("/cfg/images.txt"));
            assert_eq!(shards, "/cfg/a/s-{0..1}.tar,/abs/b.tar,s3://bucket/c.tar");
            assert_eq!(p, Path::new("s3://bucket/p.parquet"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        s.tuner.trace.as_deref(),
        Some(Path::new("/cfg/trace.jsonl"))
    );
    // A file that cannot be read: its path and why, without an empty line or key.
    let e = PipelineSpec::load(Path::new("/no/such.toml")).unwrap_err();
    assert!(
        e.to_string().starts_with("/no/such.toml: cannot read"),
        "{e}"
    );
}

#[test]
fn bad_files_name_the_key_and_line() {
    let e = error(&GOOD.replace("size = 16", "size = 16\nsise = 3"));
    assert_eq!((e.line, e.key.as_str()), (13, "batch.sise"), "{e}");
    assert!(e.message.contains("unknown field"), "{e}");
    let e = error(&GOOD.replace("size = 16", "size = \"many\""));
    assert_eq!((e.line, e.key.as_str()), (12, "batch.size"), "{e}");
    let e = error(&GOOD.replace("size = 16", "size = 0"));
    assert_eq!((e.line, e.key.as_str()), (12, "batch.size"), "{e}");
    let e = error(&GOOD.replace("crop = 224", "crop = 300"));
    assert_eq!((e.line, e.key.as_str()), (9, "decode.crop"), "{e}");
    // Buckets without length-aware batches too (refused later without the line before).
    for bad in ["0", "1001"] {
        let e = error(&GOOD.replace("size = 16", &format!("size = 16\nbuckets = {bad}")));
        assert_eq!((e.line, e.key.as_str()), (13, "batch.buckets"), "{e}");
        assert_eq!(e.message, format!("must be in 1..=1000, not {bad}"));
    }
    let e = error(&GOOD.replace("kind = \"list\"\npath = \"images.txt\"\n", ""));
    assert!(e.to_string().contains("kind"), "{e}");
    let e = error("[decode]\nkind = \"image\"\n");
    assert!(e.message.contains("missing field `source`"), "{e}");
    // The library's reading of an address, as Python's `metrics_port=`: a port on loopback,
    // or HOST:PORT (a scraper on another machine); a port out of range is refused.
    for good in ["\"9000\"", "9000", "\"0.0.0.0:9000\"", "\"[::1]:0\""] {
        let text = format!("{GOOD}\n[metrics]\nprometheus = {good}\n");
        let spec = PipelineSpec::parse(&text, "p.toml");
        assert!(spec.is_ok(), "{good}: {:?}", spec.err());
    }
    let e = error(&format!(
        "{GOOD}\n[metrics]\nprometheus = \"0.0.0.0:90000\"\n"
    ));
    assert_eq!(e.key, "metrics.prometheus", "{e}");
    assert!(
        e.message.contains("the port must be a number in 0..=65535"),
        "{e}"
    );
    let e = error(&GOOD.replace("kind = \"image\"", "kind = \"hologram\""));
    assert_eq!(e.line, 7, "{e}");
    // A misspelt key in a table: its own line and dotted name, not the table's header.
    let e = error(&GOOD.replace("path = \"images.txt\"", "paht = \"images.txt\""));
    assert_eq!((e.line, e.key.as_str()), (4, "source.paht"), "{e}");
    let e = error("");
    assert_eq!(e.to_string(), "p.toml: source: missing field `source`");
}

/// The fuzz target's property, in every test run: mutated pipeline files (numbers swapped
/// for extremes, lines dropped or repeated, bytes flipped) parse or give an error; none
/// panics, and one that parses builds its recipe (or names a missing feature) without a
/// panic.
#[test]
fn mutated_files_parse_or_fail_cleanly() {
    let seeds: Vec<String> =
        std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/configs"))
            .unwrap()
            .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
            .chain([GOOD.to_owned()])
            .collect();
    let extremes = [
        "0",
        "-1",
        "1e308",
        "nan",
        "inf",
        "18446744073709551615",
        "4294967296",
        "\"x\"",
        "[]",
        "{}",
        "true",
    ];
    let mut rng = flowgate_tuner::Rng::new(7);
    for _ in 0..3000 {
        let base = &seeds[rng.next_u64() as usize % seeds.len()];
        let mut lines: Vec<String> = base.lines().map(str::to_owned).collect();
        let i = rng.next_u64() as usize % lines.len().max(1);
        match rng.next_u64() % 4 {
            0 => {
                if let Some((k, _)) = lines[i].clone().split_once('=') {
                    let v = extremes[rng.next_u64() as usize % extremes.len()];
                    lines[i] = format!("{k}= {v}");
                }
            }
            1 => {
                lines.remove(i);
            }
            2 => {
                let l = lines[i].clone();
                lines.insert(i, l);
            }
            _ => {
                let mut b = lines[i].clone().into_bytes();
                if !b.is_empty() {
                    let j = rng.next_u64() as usize % b.len();
                    b[j] = b[j].wrapping_add(1 + (rng.next_u64() % 200) as u8);
                }
                lines[i] = String::from_utf8_lossy(&b).into_owned();
            }
        }
        let text = lines.join("\n");
        if let Ok(spec) = PipelineSpec::parse(&text, "m.toml") {
            let _ = spec.recipe();
            let _ = spec.tuner_settings();
        }
    }
}

#[test]
fn every_number_is_bounded() {
    for (from, to, key) in [
        ("size = 16", "size = 100000", "batch.size"),
        ("crop = 224", "crop = 20000\ntrain = true", "decode.crop"),
        ("resize = 256", "resize = 1000000", "decode.resize"),
        ("crop = 224", "crop = 224\nworkers = 5000", "decode.workers"),
    ] {
        let e = error(&GOOD.replace(from, to));
        assert_eq!(e.key, key, "{e}");
        assert!(
            e.message.contains("at most") || e.message.contains("..="),
            "{e}"
        );
    }
    let audio = "[source]\nkind = \"list\"\npath = \"a.txt\"\n[decode]\nkind = \"audio\"\n";
    for (extra, key) in [
        ("rate = 4000000000", "decode.rate"),
        ("seconds = 1e9", "decode.seconds"),
    ] {
        let e = error(&format!("{audio}{extra}\n"));
        assert_eq!(e.key, key, "{e}");
    }
    let e = error(&format!("{GOOD}\n[run]\nstep_ms = 1e12\n"));
    assert_eq!(e.key, "run.step_ms", "{e}");
    let e = error(&format!("{GOOD}\n[tuner]\nmemory_mb = 1e30\n"));
    assert_eq!(e.key, "tuner.memory_mb", "{e}");
}

#[test]
fn numbers_that_size_buffers_caches_and_epochs_are_bounded() {
    let tar = "[source]\nkind = \"tar\"\nshards = \"s-{0..3}.tar\"\n";
    for (extra, key) in [
        ("buffer = 10000000000000", "source.buffer"),
        ("prefetch = 1000000", "source.prefetch"),
        ("cache_mb = 1e30", "source.cache_mb"),
        ("cache_mb = -1.0", "source.cache_mb"),
    ] {
        let e = error(&format!("{tar}{extra}\n[decode]\nkind = \"image\"\n"));
        assert_eq!(e.key, key, "{e}");
        assert!(e.to_string().contains("must be in"), "{e}");
    }
    let mix = "[source]\nkind = \"mix\"\nweights = [1.0]\ndraws = 10000000000000\n\
               [[source.sources]]\nkind = \"tar\"\nshards = \"s.tar\"\nprefetch = 5000\n\
               [decode]\nkind = \"image\"\n";
    let e = error(mix);
    assert_eq!(e.key, "source.draws", "{e}");
    // In the words Python's `Mix(draws=-1)` says.
    let e = error(&mix.replace("draws = 10000000000000", "draws = -1"));
    assert!(
        e.to_string().ends_with("must be in 1..=4294967296, not -1"),
        "{e}"
    );
    let e = error(&mix.replace("draws = 10000000000000", "draws = 10"));
    assert_eq!(e.key, "source.sources.prefetch", "{e}");
    let e = error(&format!("{GOOD}\n[run]\nepochs = 99999999999\n"));
    assert_eq!(e.key, "run.epochs", "{e}");
    for (run, says) in [
        ("seconds = 0", "must be in (0"),
        ("seconds = 1e12", "must be in (0"),
        (
            "step_changes = [{ at_s = 5.0, ms = 1.0 }, { at_s = 2.0, ms = 9.0 }]",
            "change 2: at_s 2 must be in 5..=",
        ),
        (
            "step_changes = [{ at_s = 1.0, ms = -1.0 }]",
            "change 1: ms -1",
        ),
        (
            "step_changes = [{ at_s = -1.0, ms = 1.0 }]",
            "change 1: at_s -1",
        ),
    ] {
        let e = error(&format!("{GOOD}\n[run]\n{run}\n"));
        assert!(e.key.starts_with("run."), "{e}");
        assert!(e.to_string().contains(says), "{run}: {e}");
    }
}

#[test]
fn the_step_follows_its_changes() {
    let spec = crate::spec::PipelineSpec::parse(
        &format!("{GOOD}\n[run]\nstep_ms = 1.0\nstep_changes = [{{ at_s = 10.0, ms = 250.0 }}, {{ at_s = 20.0, ms = 2.0 }}]\n"),
        "t.toml",
    )
    .unwrap();
    let at: Vec<f64> = [0.0, 9.9, 10.0, 19.0, 20.0, 99.0]
        .iter()
        .map(|&t| spec.run.step_at(t))
        .collect();
    assert_eq!(at, [1.0, 1.0, 250.0, 250.0, 2.0, 2.0]);
}

#[test]
fn a_bad_value_in_source_or_decode_names_its_key_and_line_in_words() {
    let text = "[source]\nkind = \"list\"\npath = \"x.txt\"\nshuffle = \"yes\"\n\n\
                [decode]\nkind = \"image\"\ncrop = 224\n";
    let e = error(text);
    assert_eq!((e.key.as_str(), e.line), ("source.shuffle", 4), "{e}");
    assert!(e.message.contains("expected a whole number"), "{e}");
    let text = "[source]\nkind = \"list\"\npath = \"x.txt\"\n\n[decode]\nkind = \"image\"\n\
                crop = 224\nresize = \"256\"\n";
    let e = error(text);
    assert_eq!((e.key.as_str(), e.line), ("decode.resize", 8), "{e}");
    let e = error(&text.replace("resize = \"256\"", "draft = 3"));
    assert_eq!((e.key.as_str(), e.line), ("decode.draft", 8), "{e}");
    assert!(e.message.contains("expected true or false"), "{e}");
    let e = error(&format!("{GOOD}\n[run]\nmax_failures = \"x\"\n"));
    assert_eq!(e.key, "run.max_failures", "{e}");
    assert!(e.message.contains("a count of failures"), "{e}");
}

#[test]
fn a_cpu_budget_is_a_count_a_fraction_or_a_percentage() {
    for (text, want) in [
        ("2", CpuBudget::Cores(2)),
        ("0.4", CpuBudget::Fraction(0.4)),
        ("\"40%\"", CpuBudget::Fraction(0.4)),
    ] {
        let spec =
            PipelineSpec::parse(&format!("{GOOD}\n[tuner]\ncpu_budget = {text}\n"), "t").unwrap();
        assert_eq!(spec.tuner.cpu_budget, Some(want), "{text}");
    }
    for bad in ["0", "1.5", "-2", "\"lots\"", "5000", "true"] {
        let e = error(&format!("{GOOD}\n[tuner]\ncpu_budget = {bad}\n"));
        assert!(e.to_string().contains("cpu_budget"), "{bad}: {e}");
    }
}

#[test]
fn a_media_field_table_parses_and_a_bad_one_names_its_field() {
    let with = |table: &str| {
        GOOD.replace(
            "[source]\nkind = \"list\"\npath = \"images.txt\"\n",
            &format!(
                "[source]\nkind = \"tar\"\nshards = \"s-{{0..3}}.tar\"\n\n[fields]\ncaption = \
                 \"txt\"\n{table}\n"
            ),
        )
    };
    let good = with("depth = { from = \"depth.png\", kind = \"image\", resize = 16, crop = 8 }");
    PipelineSpec::parse(&good, "p.toml").unwrap();
    let (specs, media) = crate::loader::fields_and_media(
        PipelineSpec::parse(&good, "p.toml")
            .unwrap()
            .fields
            .unwrap(),
    )
    .unwrap();
    assert_eq!(media.len(), 1);
    assert_eq!(media[0].name, "depth");
    assert!(specs.iter().any(|s| s.name == "depth"));
    let e = error(&with(
        "depth = { from = \"depth.png\", kind = \"image\", optional = true }",
    ));
    assert!(e.to_string().contains("a media field is required"), "{e}");
    assert!(e.to_string().contains("depth"), "{e}");
    let e = error(&with(
        "depth = { from = \"depth.png\", kind = \"image\", crops = 8 }",
    ));
    assert!(e.to_string().contains("depth"), "{e}");
    // Its recipe's numbers and its name are checked with the file, not when the run starts.
    let e = error(&with(
        "depth = { from = \"depth.png\", kind = \"image\", resize = 16, crop = 32 }",
    ));
    assert_eq!(e.key, "fields.depth", "{e}");
    assert!(e.line > 0 && e.message.contains("crop"), "{e}");
    let e = error(&with(
        "image = { from = \"depth.png\", kind = \"image\", crop = 8 }",
    ));
    assert_eq!(e.key, "fields.image", "{e}");
    // A plain field by the loader's rule too ([`BatchKeys`]): named as the media, or `label`
    // where the source has labels; `label` is a field's name where it has none.
    let e = error(&with("image = \"jpg\""));
    assert_eq!(e.key, "fields.image", "{e}");
    assert!(e.message.contains("is a key the batch already has"), "{e}");
    PipelineSpec::parse(&with("label = \"cls\""), "p.toml").unwrap();
    let labelled = with("label = \"cls\"").replace("shards = ", "labels = \"cls\"\nshards = ");
    let e = error(&labelled);
    assert_eq!(e.key, "fields.label", "{e}");
    assert!(e.message.starts_with("fields: \"label\" is a key"), "{e}");
}

#[cfg(feature = "video")]
#[test]
fn a_rule_of_the_cap_names_the_batch_tables_key() {
    // The media's rule named Python's `max_batch_frames`, under `[decode]`.
    let text = "[source]\nkind = \"list\"\npath = \"v.txt\"\n[decode]\nkind = \"video\"\n\
                fps = 5.0\nlayout = \"ncthw\"\n[batch]\nmax_frames = 64\n";
    let e = error(text);
    assert_eq!((e.key.as_str(), e.line), ("batch.max_frames", 9), "{e}");
}

const NEW: &str = r#"
[source]
kind = "tar"
shards = "data/*.tar"

[loader]
batch_size = 16
seed = 7
drop_last = true
order = "completion"
workers = 3
skip_errors = false
fill_skipped = true
memory_mb = 512
rank = 1
world_size = 2

[decode]
kind = "image"
"#;

#[test]
fn the_loader_table_is_the_librarys_settings_by_the_same_names() {
    let s = PipelineSpec::parse(NEW, "p.toml").unwrap();
    let want = crate::loader::LoaderSettings::from_value(serde_json::json!({
        "batch_size": 16, "seed": 7, "drop_last": true, "order": "completion", "workers": 3,
        "skip_errors": false, "fill_skipped": true, "memory_mb": 512, "rank": 1,
        "world_size": 2,
    }))
    .unwrap();
    assert_eq!(s.loader_settings(), want);
    assert!(s.deprecated.is_empty(), "{:?}", s.deprecated);
    // Absent keys are the library's defaults: shuffled (seed 0), failures skipped, the media's
    // batch size; a tar source's shuffle buffer the library's too.
    let bare = "[source]\nkind = \"tar\"\nshards = \"d/*.tar\"\n[decode]\nkind = \"image\"\n";
    let s = PipelineSpec::parse(bare, "p.toml").unwrap();
    let library = crate::loader::LoaderSettings {
        batch_size: Some(crate::loader::DEFAULT_BATCH_SIZE),
        ..Default::default()
    };
    assert_eq!(s.loader_settings(), library);
    assert_eq!(s.shuffle_seed(), Some(0));
    match s.source {
        SourceSpec::Tar { buffer, .. } => assert_eq!(buffer, crate::dataset::DEFAULT_BUFFER),
        other => panic!("{other:?}"),
    }
    let off = PipelineSpec::parse(&format!("{bare}[loader]\nshuffle = false\n"), "p.toml");
    assert_eq!(off.unwrap().shuffle_seed(), None, "the source's order");
}

#[test]
fn the_older_keys_are_read_into_the_loader_each_with_a_deprecation_line() {
    let old = r#"
[source]
kind = "list"
path = "images.txt"
shuffle = 5

[decode]
kind = "image"
workers = 2

[batch]
size = 8
drop_last = true

[tuner]
memory_mb = 300
"#;
    let s = PipelineSpec::parse(old, "p.toml").unwrap();
    let l = s.loader_settings();
    assert_eq!(
        (
            l.batch_size,
            l.shuffle,
            l.seed,
            l.workers,
            l.drop_last,
            l.memory_mb
        ),
        (Some(8), true, 5, Some(2), true, Some(300.0))
    );
    assert_eq!(s.deprecated.len(), 5, "{:#?}", s.deprecated);
    for key in [
        "source.shuffle",
        "decode.workers",
        "batch.size",
        "batch.drop_last",
    ] {
        assert!(
            s.deprecated.iter().any(|d| d.contains(key)),
            "{key}: {:#?}",
            s.deprecated
        );
    }
    assert!(s.deprecated.iter().any(|d| d.contains("loader.batch_size")));
    // An older key out of range is named where the file wrote it.
    let e = error(&old.replace("workers = 2", "workers = 0"));
    assert_eq!(e.key, "decode.workers", "{e}");
    // The same setting given both ways is refused, naming both.
    for (extra, key) in [
        ("[loader]\nbatch_size = 4\n", "batch.size"),
        ("[loader]\nseed = 1\n", "source.shuffle"),
        ("[loader]\nshuffle = false\n", "source.shuffle"),
        ("[loader]\nworkers = 1\n", "decode.workers"),
    ] {
        let e = error(&format!("{old}{extra}"));
        assert_eq!(e.key, key, "{e}");
        assert!(e.message.contains("give it once, as loader."), "{e}");
    }
    let e = error(&format!(
        "{GOOD}[run]\nmax_failures = 3\n[loader]\nskip_errors = false\n"
    ));
    assert_eq!(e.key, "loader.skip_errors", "{e}");
}

#[test]
fn a_loader_key_out_of_range_is_refused_in_the_librarys_words_at_its_line() {
    for (key, value) in [
        ("batch_size", "0"),
        ("workers", "100000"),
        ("memory_mb", "-1"),
        ("buckets", "0"),
    ] {
        let text = format!("{GOOD}[loader]\n{key} = {value}\n").replace("[batch]\nsize = 16\n", "");
        let e = error(&text);
        assert_eq!(e.key, format!("loader.{key}"), "{e}");
        assert_eq!(e.line, text.lines().count(), "{e}");
        let value = serde_json::from_str(&format!("{{\"{key}\": {value}}}")).unwrap();
        let library = crate::loader::LoaderSettings::from_value(value)
            .and_then(|s| s.check().map_err(|e| e.to_string()))
            .unwrap_err();
        assert!(
            library.contains(&e.message),
            "{e} against the library's {library}"
        );
    }
    let e = error(&format!("{GOOD}[loader]\nrank = 2\nworld_size = 2\n"));
    assert_eq!(e.key, "loader.rank", "{e}");
    assert!(
        e.message.starts_with("must be in 0..2"),
        "the key said once: {e}"
    );
    let e = error(&format!("{GOOD}[loader]\nrank = 1\n"));
    assert_eq!(e.key, "loader.rank", "{e}");
    assert!(e.message.contains("give both rank and world_size"), "{e}");
}

#[test]
fn a_file_of_older_keys_without_a_shuffle_is_told_it_now_shuffles() {
    let s = PipelineSpec::parse(GOOD, "p.toml").unwrap();
    assert_eq!(s.shuffle_seed(), Some(0));
    assert!(
        s.deprecated
            .iter()
            .any(|d| d.contains("now shuffles by default")),
        "{:#?}",
        s.deprecated
    );
    let kept = PipelineSpec::parse(&format!("{GOOD}[loader]\nshuffle = false\n"), "p.toml");
    let kept = kept.unwrap();
    assert_eq!(kept.shuffle_seed(), None);
    assert!(!kept.deprecated.iter().any(|d| d.contains("now shuffles")));
}
