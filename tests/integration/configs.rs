//! Pipeline files: every sample config in `examples/configs/` parses and runs on a generated
//! sample dataset (S3 and video where those features are built), augmentation follows the one
//! seeding rule, and the Rust API and a pipeline file give the same batches. (The `flowgate`
//! command's own tests are in `cli/tests/`.)

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flowgate::dataset::Files;
use flowgate::media::Recipe;
use flowgate::spec::{Hooks, PipelineSpec};
use flowgate::synth::{write_dataset, DatasetSpec};
use flowgate::{Pipeline, Workers};

/// One small dataset for every test of this file, kept in cargo's test scratch folder
/// (`target/tmp`) and rewritten each run (the generator is deterministic).
fn dataset() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("configs-dataset");
        let _ = std::fs::remove_dir_all(&dir);
        write_dataset(&DatasetSpec {
            out: dir.clone(),
            images: 40,
            audio: 10,
            audio_seconds: (3.0, 10.0),
            flac: true,
            video: if cfg!(feature = "video") { 3 } else { 0 },
            shards: 10,
            seed: 7,
        })
        .expect("write the sample dataset")
    })
}

/// A sample config, pointed at the test's dataset.
fn config(name: &str) -> String {
    let text = std::fs::read_to_string(Path::new("examples/configs").join(name)).unwrap();
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR"));
    text.replace(
        "../../target/sample-data/",
        &format!("{}/", dataset().display()),
    )
    // Anything else the file writes under `target/` (a tuner trace) goes to the scratch folder.
    .replace("../../target/", &format!("{}/", scratch.display()))
}

fn run(name: &str) -> Result<usize, String> {
    let spec = PipelineSpec::parse(&config(name), name).map_err(|e| e.to_string())?;
    let mut loader = spec.build(Hooks::default()).map_err(|e| e.to_string())?;
    let mut items = 0;
    // At most three epochs (the main job's file runs for 30 s through a thousand).
    for _ in 0..spec.run.epochs.min(3) {
        for batch in loader.epoch().unwrap() {
            items += batch.map_err(|e| e.to_string())?.shape()[0];
        }
    }
    assert_eq!(loader.stats().failures, 0, "{name}");
    Ok(items)
}

#[test]
fn every_sample_config_runs_on_the_sample_dataset() {
    let mut names: Vec<String> = std::fs::read_dir("examples/configs")
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".toml"))
        .collect();
    names.sort();
    assert!(names.len() >= 5, "{names:?}");
    for name in &names {
        let result = run(name);
        let needs = |feature: &str| match &result {
            Err(e) => assert!(e.contains(&format!("`{feature}` feature")), "{name}: {e}"),
            Ok(_) => panic!("{name} ran without the `{feature}` feature"),
        };
        match name.as_str() {
            "s3.toml" if !cfg!(feature = "s3") => needs("s3"),
            "video.toml" if !cfg!(feature = "video") => needs("video"),
            _ => {
                let items = result.unwrap_or_else(|e| panic!("{name}: {e}"));
                let spec = PipelineSpec::parse(&config(name), name).unwrap();
                let per_epoch = match name.as_str() {
                    "audio.toml" => 10,
                    "video.toml" => 3,
                    _ => 40,
                };
                let per_epoch = if spec.loader_settings().drop_last {
                    per_epoch / spec.batch_size() * spec.batch_size()
                } else {
                    per_epoch
                };
                assert_eq!(
                    items as u64,
                    per_epoch as u64 * spec.run.epochs.min(3),
                    "{name}"
                );
            }
        }
    }
}

/// Every batch of a run of `epochs` epochs, as bytes.
fn batches(toml: &str, epochs: u64) -> Vec<Vec<u8>> {
    let spec = PipelineSpec::parse(toml, "t.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    let mut out = Vec::new();
    for _ in 0..epochs {
        for b in loader.epoch().unwrap() {
            out.push(b.unwrap().into_host().unwrap().bytes().to_vec());
        }
    }
    out
}

#[test]
fn training_augmentation_is_drawn_anew_every_epoch() {
    let list = dataset().join("images.txt");
    let audio = dataset().join("audio.txt");
    for (list, decode) in [
        (&list, "kind = \"image\"\ncrop = 64\nresize = 64"),
        (&audio, "kind = \"audio\"\nseconds = 1.0"),
    ] {
        let toml = |train: bool| {
            format!(
                "[source]\nkind = \"list\"\npath = \"{}\"\n[loader]\nshuffle = false\nworkers = 1\nbatch_size = 64\n[decode]\n{decode}\ntrain = {train}\n[run]\nepochs = 2\n[tuner]\nenabled = false\n",
                list.display()
            )
        };
        // One batch per epoch, items in list order (one worker, no shuffle).
        let fixed = batches(&toml(false), 2);
        assert_eq!(fixed.len(), 2);
        assert_eq!(fixed[0], fixed[1], "{decode}: evaluation crops repeat");
        let train = batches(&toml(true), 2);
        assert_ne!(
            train[0], train[1],
            "{decode}: a new augmentation in epoch 2"
        );
        assert_eq!(batches(&toml(true), 2), train, "{decode}: reproducible");
    }
}

/// A pipeline file of one worker, tuner off, no shuffle (so batches come in list order).
fn one_worker_file(list: &Path, decode: &str, batch: usize, epochs: u64) -> String {
    format!(
        "[source]\nkind = \"list\"\npath = \"{}\"\n[loader]\nshuffle = false\nworkers = 1\nbatch_size = {batch}\n[decode]\n{decode}\n[run]\nepochs = {epochs}\n[tuner]\nenabled = false\n",
        list.display()
    )
}

/// The same batches from the Rust API: the same files, recipe, seed and epochs.
fn rust_batches(list: &Path, recipe: Recipe, batch: usize, epochs: u64) -> Vec<Vec<u8>> {
    let files = Files::list(list).unwrap();
    let mut pipeline = Pipeline::builder()
        .source_epochs(move |e| files.epoch(e).into_iter().map(move |p| (p, e)))
        .pipe(
            "decode",
            move |(p, e): (PathBuf, u64)| recipe.for_epoch(e).load(&p),
            Workers::fixed(1),
        )
        .batch(batch, false)
        .autotune_off()
        .build()
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..epochs {
        for b in pipeline.iter() {
            out.push(b.unwrap().bytes().to_vec());
        }
    }
    out
}

#[test]
fn the_rust_api_and_a_pipeline_file_give_the_same_batches() {
    use flowgate::media::audio::AudioRecipe;
    use flowgate::media::image::ImageRecipe;
    let images = dataset().join("images.txt");
    let audio = dataset().join("audio.txt");
    for seed in [0u64, 11] {
        let image = Recipe::image(ImageRecipe {
            resize: 72,
            normalize: None,
            ..ImageRecipe::train(64)
        })
        .unwrap()
        .with_seed(seed);
        let file = one_worker_file(
            &images,
            &format!("kind = \"image\"\nresize = 72\ncrop = 64\ntrain = true\nseed = {seed}"),
            16,
            2,
        );
        let (from_file, from_rust) = (batches(&file, 2), rust_batches(&images, image, 16, 2));
        assert_eq!(from_file.len(), 6, "3 batches per epoch");
        assert!(from_file == from_rust, "images, seed {seed}");
        assert_ne!(from_file[0], from_file[3], "epoch 2 draws anew");

        let clip = Recipe::audio(AudioRecipe {
            random_crop: true,
            ..AudioRecipe::with_seconds(16_000, 1.0).unwrap()
        })
        .unwrap()
        .with_seed(seed);
        let file = one_worker_file(
            &audio,
            &format!("kind = \"audio\"\nseconds = 1.0\ntrain = true\nseed = {seed}"),
            4,
            2,
        );
        assert!(
            batches(&file, 2) == rust_batches(&audio, clip, 4, 2),
            "audio, seed {seed}"
        );
    }
    // A different seed draws different crops.
    let file = |seed: u64| {
        one_worker_file(
            &images,
            &format!("kind = \"image\"\nresize = 72\ncrop = 64\ntrain = true\nseed = {seed}"),
            16,
            1,
        )
    };
    assert_ne!(batches(&file(0), 1), batches(&file(11), 1));
}

#[test]
fn a_mixture_draws_from_each_source_by_weight_and_refuses_what_it_cannot_mix() {
    let list = dataset().join("images.txt");
    let shards = dataset().join("shards");
    let toml = |weights: &str, extra: &str| {
        format!(
            "[source]\nkind = \"mix\"\nweights = {weights}\nshuffle = 3\n{extra}\n\
             [[source.sources]]\nkind = \"tar\"\nshards = \"{}\"\n\
             [[source.sources]]\nkind = \"list\"\npath = \"{}\"\n\
             [decode]\nkind = \"image\"\nresize = 16\ncrop = 16\nworkers = 1\n\
             [batch]\nsize = 10\n",
            shards.display(),
            list.display()
        )
    };
    // A number of draws: exactly that many items an epoch.
    let spec = PipelineSpec::parse(&toml("[0.75, 0.25]", "draws = 400"), "m.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    assert_eq!(loader.items, 400);
    let n: usize = loader.epoch().unwrap().map(|b| b.unwrap().shape()[0]).sum();
    assert_eq!(n, 400);
    // "first": at most one pass of each source, so at most 80 items; "all": at least one
    // pass of each, at least 80.
    for (stop, check) in [("first", 0usize), ("all", 1)] {
        let spec =
            PipelineSpec::parse(&toml("[0.5, 0.5]", &format!("stop = \"{stop}\"")), "m.toml")
                .unwrap();
        let mut loader = spec.build(Hooks::default()).unwrap();
        let n: usize = loader.epoch().unwrap().map(|b| b.unwrap().shape()[0]).sum();
        if check == 0 {
            assert!((40..=80).contains(&n), "{stop}: {n}");
        } else {
            assert!(n >= 80, "{stop}: {n}");
        }
    }
    let e = PipelineSpec::parse(&toml("[1.0]", "draws = 10"), "m.toml").unwrap_err();
    assert!(e.to_string().contains("weights"), "{e}");
    assert!(e.to_string().contains("2 sources, 1 weights"), "{e}");
    let e = PipelineSpec::parse(&toml("[0.0, -1.0]", "draws = 10"), "m.toml").unwrap_err();
    assert!(e.to_string().contains("weights"), "{e}");
    let s3 = toml("[1.0, 1.0]", "draws = 10").replace(
        &format!("shards = \"{}\"", shards.display()),
        "shards = \"s3://bucket/x/\"",
    );
    let e = PipelineSpec::parse(&s3, "m.toml")
        .unwrap()
        .build(Hooks::default())
        .unwrap_err();
    assert!(e.to_string().contains("source.sources[0]"), "{e}");
}

/// `[device] kind = "simulated"` runs the same pipeline through the uploader (the path
/// `kind = "cuda"` takes, on a copy engine without a GPU): the same batches as `cpu`, each one
/// on the device, and an unknown device key or a non-positive budget is refused by name.
#[test]
fn a_pipeline_file_uploads_batches_to_its_device() {
    let list = dataset().join("images.txt");
    let toml = |device: &str| {
        format!(
            "[source]\nkind = \"list\"\npath = \"{}\"\n[decode]\nkind = \"image\"\ncrop = 32\nresize = 32\nworkers = 1\n[batch]\nsize = 8\n[tuner]\nenabled = false\n{device}",
            list.display()
        )
    };
    let host = batches(&toml(""), 1);
    let device = "[device]\nkind = \"simulated\"\nmemory_mb = 1\nstaging_mb = 4\n";
    let spec = PipelineSpec::parse(&toml(device), "t.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    let mut uploaded = Vec::new();
    for b in loader.epoch().unwrap() {
        let b = b.unwrap();
        assert!(
            matches!(b, flowgate::device::Delivered::Device(_)),
            "a device batch"
        );
        uploaded.push(b.into_host().unwrap().bytes().to_vec());
    }
    assert_eq!(
        uploaded, host,
        "the same batches, in order, through the uploader"
    );
    assert!(loader.stats().stage("upload").is_some());
    for (bad, key) in [
        (
            "[device]\nkind = \"simulated\"\nmemory_mb = 0\n",
            "device.memory_mb",
        ),
        (
            "[device]\nkind = \"simulated\"\nmemroy_mb = 4\n",
            "memroy_mb",
        ),
    ] {
        let e = PipelineSpec::parse(&toml(bad), "t.toml").unwrap_err();
        assert!(e.to_string().contains(key), "{e}");
    }
    // `cuda`: refused by name without the feature; with it but no GPU (CI), a clear error
    // at build.
    let cuda = PipelineSpec::parse(&toml("[device]\nkind = \"cuda\"\n"), "t.toml");
    if cfg!(feature = "cuda") {
        if std::env::var("FLOWGATE_REQUIRE_GPU").as_deref() != Ok("1") {
            let e = cuda.unwrap().build(Hooks::default()).unwrap_err();
            assert!(e.to_string().contains("device.kind = \"cuda\""), "{e}");
        }
    } else {
        let e = cuda.unwrap_err();
        assert!(e.to_string().contains("--features cuda"), "{e}");
    }
}

/// `[batch] max_frames` with `[decode] fps`: length-aware video batches from a pipeline file,
/// every clip once, at most `max_frames` padded frames a batch; `fps` alone is refused.
#[cfg(feature = "video")]
#[test]
fn a_pipeline_file_batches_video_by_frames() {
    let list = dataset().join("video.txt");
    let toml = |batch: &str| {
        format!(
            "[source]\nkind = \"list\"\npath = \"{}\"\n[decode]\nkind = \"video\"\nresize = 32\ncrop = 32\nfps = 2.0\n[batch]\n{batch}\n[tuner]\nenabled = false\n",
            list.display()
        )
    };
    let spec = PipelineSpec::parse(&toml("max_frames = 12\nbuckets = 2"), "v.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    let mut clips = 0;
    for b in loader.epoch().unwrap() {
        let b = b.unwrap();
        let shape = b.shape().to_vec();
        assert_eq!(&shape[2..], [32, 32, 3]);
        assert!(shape[0] * shape[1] <= 12, "{shape:?}");
        clips += shape[0];
    }
    assert_eq!(clips, 3);
    let e = PipelineSpec::parse(&toml("size = 2"), "v.toml").unwrap_err();
    assert!(e.to_string().contains("decode.fps"), "{e}");
    // Windows: `stride` (and `train` for a random one) instead of `fps`.
    let window =
        |extra: &str| toml("size = 3").replace("fps = 2.0\n", &format!("frames = 3\n{extra}"));
    let spec = PipelineSpec::parse(&window("stride = 2\ntrain = true\n"), "w.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    let shapes: Vec<Vec<usize>> = loader
        .epoch()
        .unwrap()
        .map(|b| b.unwrap().shape().to_vec())
        .collect();
    assert_eq!(shapes.iter().map(|s| s[0]).sum::<usize>(), 3);
    assert!(
        shapes.iter().all(|s| s[1..] == [3, 32, 32, 3]),
        "{shapes:?}"
    );
    let e = PipelineSpec::parse(&window("train = true\n"), "w.toml").unwrap_err();
    assert!(e.to_string().contains("decode.stride"), "{e}");
}

/// `loader.order`: the epoch's order by default (here the list's, `shuffle = false`), even with
/// several workers and the tuner on (so a run repeats), `"completion"` on request, anything
/// else an error naming the key.
#[test]
fn batches_come_in_the_files_order_by_default_and_the_order_key_is_checked() {
    let list = dataset().join("images.txt");
    let toml = |order: &str| {
        format!(
            "[source]\nkind = \"list\"\npath = \"{}\"\n[decode]\nkind = \"image\"\nresize = 48\ncrop = 48\n[loader]\nshuffle = false\nworkers = 2\nbatch_size = 7\n{order}\n",
            list.display()
        )
    };
    let one_worker = batches(
        &one_worker_file(&list, "kind = \"image\"\nresize = 48\ncrop = 48", 7, 1),
        1,
    );
    assert_eq!(
        batches(&toml(""), 1),
        one_worker,
        "two workers, the list's order"
    );
    let completion = batches(&toml("order = \"completion\""), 1);
    assert_eq!(completion.len(), one_worker.len());
    let e = PipelineSpec::parse(&toml("order = \"sideways\""), "o.toml").unwrap_err();
    assert!(e.to_string().contains("loader.order"), "{e}");
    assert!(e.to_string().contains("o.toml:"), "{e}");
}

/// A tar source's `labels` names the field holding each sample's label; the batches carry
/// them (the sample data's `cls`: the image's number modulo 1000).
#[test]
fn a_pipeline_files_tar_source_carries_its_samples_labels() {
    let shards = dataset().join("shards");
    let toml = format!(
        "[source]\nkind = \"tar\"\nshards = \"{}\"\nlabels = \"cls\"\n\
         [decode]\nkind = \"image\"\nresize = 16\ncrop = 16\n[batch]\nsize = 16\n",
        shards.display()
    );
    let spec = PipelineSpec::parse(&toml, "l.toml").unwrap();
    let mut job = spec.build(Hooks::default()).unwrap();
    let mut labels = Vec::new();
    for b in job.loader.epoch().unwrap() {
        let b = b.unwrap();
        let values = b.label_values().expect("labels");
        assert_eq!(values.len(), b.len());
        labels.extend(values);
    }
    labels.sort_unstable();
    assert_eq!(labels, (0..job.items as i64).collect::<Vec<_>>());
}

#[test]
fn a_files_budgets_hold_with_the_tuner_off() {
    // A batch of 32 crops of 224² (4.6 MiB) cannot be held in flight within 1 MiB: refused
    // when the loader is built, whether the tuner runs or not.
    let list = dataset().join("images.txt");
    for enabled in [true, false] {
        let text = format!(
            "[source]\nkind = \"list\"\npath = \"{}\"\n[decode]\nkind = \"image\"\nresize = 256\ncrop = 224\n[batch]\nsize = 32\n[tuner]\nenabled = {enabled}\nmemory_mb = 1\n",
            list.display()
        );
        let spec = PipelineSpec::parse(&text, "t.toml").unwrap();
        let e = spec.build(Hooks::default()).expect_err("refused");
        assert!(
            e.to_string().contains("cannot hold a batch in flight"),
            "tuner {enabled}: {e}"
        );
    }
}

#[test]
fn a_pipeline_file_and_the_library_refuse_the_same_numbers_in_the_same_words() {
    use flowgate::dataset::{Dataset, Source};
    use flowgate::limits;
    let list = dataset().join("images.txt");
    let file = |source: &str, decode: &str, batch: &str| {
        format!(
            "[source]\n{source}\n[decode]\nkind = \"image\"\nresize = 32\ncrop = 32\n{decode}\n[batch]\n{batch}\n"
        )
    };
    let list_source = format!("kind = \"list\"\npath = \"{}\"", list.display());
    let tar = "kind = \"tar\"\nshards = \"s-{0..3}.tar\"";
    let cases = [
        (
            file(&list_source, "", "size = 70000"),
            "batch.size",
            limits::BATCH_SIZE.check(70000).unwrap_err(),
        ),
        (
            file(&list_source, "workers = 5000", "size = 4"),
            "decode.workers",
            limits::WORKERS.check(5000).unwrap_err(),
        ),
        (
            file(&format!("{tar}\nprefetch = 5000"), "", "size = 4"),
            "source.prefetch",
            limits::PREFETCH.check(5000).unwrap_err(),
        ),
        (
            file(&format!("{tar}\nbuffer = 10000000000"), "", "size = 4"),
            "source.buffer",
            limits::BUFFER.check(10_000_000_000).unwrap_err(),
        ),
        (
            file(&format!("{tar}\ncache_mb = -1.0"), "", "size = 4"),
            "source.cache_mb",
            limits::CACHE_MB.bytes(-1.0).unwrap_err(),
        ),
    ];
    for (text, key, want) in cases {
        let e = PipelineSpec::parse(&text, "t.toml").unwrap_err();
        assert_eq!((e.key.as_str(), &e.message), (key, &want.message), "{e}");
    }
    // The device's memory, as Python's device_memory_mb (1e12 used to be taken).
    for mb in ["-1.0", "1e12"] {
        let text = file(&list_source, "", "size = 4") + &format!("[device]\nmemory_mb = {mb}\n");
        let e = PipelineSpec::parse(&text, "t.toml").unwrap_err();
        let want = limits::DEVICE_MEMORY_MB
            .bytes(mb.parse().unwrap())
            .unwrap_err();
        assert_eq!(
            (e.key.as_str(), &e.message),
            ("device.memory_mb", &want.message),
            "{e}"
        );
    }
    // The library's builders say the same after the setting's name.
    let recipe = || Recipe::image(flowgate::media::image::ImageRecipe::default()).unwrap();
    let files = || Dataset::builder(Source::list(&list)).build().unwrap();
    let e = flowgate::Loader::builder(files(), recipe())
        .batch_size(70000)
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains(&limits::BATCH_SIZE.check(70000).unwrap_err().to_string()),
        "{e}"
    );
    let e = flowgate::Loader::builder(files(), recipe())
        .workers(5000)
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("workers: must be in 1..=1024, not 5000"),
        "{e}"
    );
    let e = Dataset::builder(Source::list(&list).buffer(10_000_000_000))
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("buffer: must be in 0..=4294967296, not 10000000000"),
        "{e}"
    );
}
