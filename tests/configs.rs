//! Pipeline files: every sample config in `examples/configs/` parses and runs on a generated
//! sample dataset (S3 and video where those features are built), `flowgate run` works end to end
//! and reports bad files with the key and line, and `flowgate gen-data` writes the dataset.
#![cfg(all(feature = "cli", feature = "image", feature = "audio"))]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use flowgate::media::synth::{write_dataset, DatasetSpec};
use flowgate::spec::{Hooks, PipelineSpec};

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
            flac: true,
            video: if cfg!(feature = "video") { 3 } else { 0 },
            seed: 7,
        })
        .expect("write the sample dataset")
    })
}

/// A sample config, pointed at the test's dataset.
fn config(name: &str) -> String {
    let text = std::fs::read_to_string(Path::new("examples/configs").join(name)).unwrap();
    text.replace("target/sample-data/", &format!("{}/", dataset().display()))
}

fn run(name: &str) -> Result<usize, String> {
    let spec = PipelineSpec::parse(&config(name), name).map_err(|e| e.to_string())?;
    let mut loader = spec.build(Hooks::default()).map_err(|e| e.to_string())?;
    let mut items = 0;
    for _ in 0..spec.run.epochs {
        for batch in loader.pipeline.iter() {
            items += batch.map_err(|e| e.to_string())?.shape()[0];
        }
    }
    assert_eq!(loader.pipeline.stats().failures, 0, "{name}");
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
                let per_epoch = if spec.batch.drop_last {
                    per_epoch / spec.batch.size * spec.batch.size
                } else {
                    per_epoch
                };
                assert_eq!(items as u64, per_epoch as u64 * spec.run.epochs, "{name}");
            }
        }
    }
}

#[test]
fn flowgate_run_prints_decisions_a_summary_and_json() {
    let file = std::env::temp_dir().join(format!("flowgate-run-{}.toml", std::process::id()));
    std::fs::write(&file, config("image_classification.toml")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_flowgate"))
        .arg("run")
        .arg(&file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("epoch 3:"), "{stdout}");
    assert!(stdout.contains("decode"), "the summary table: {stdout}");
    let json: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap()).expect("a JSON last line");
    assert_eq!(json["items"], 120);
    assert_eq!(json["failures"], 0);
    assert_eq!(json["batch_shape"][1], 3);
    assert!(stderr.contains("bottleneck"), "the live view: {stderr}");
    let _ = std::fs::remove_file(file);
}

#[test]
fn bad_files_give_one_error_naming_the_key_and_line() {
    let cases = [
        (
            "size = 32",
            "size = 32\nbatchsize = 3",
            "batch.batchsize",
            "unknown field",
        ),
        ("size = 32", "size = \"32\"", "batch.size", "invalid type"),
        ("crop = 224", "crop = 512", "decode.crop", "must be in"),
        ("epochs = 3", "epochs = 0", "run.epochs", "at least 1"),
    ];
    let good = config("image_classification.toml");
    for (from, to, key, what) in cases {
        let text = good.replacen(from, to, 1);
        let line = text
            .lines()
            .position(|l| l.contains(to.lines().last().unwrap()))
            .unwrap()
            + 1;
        let file = std::env::temp_dir().join(format!("flowgate-bad-{}.toml", std::process::id()));
        std::fs::write(&file, &text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_flowgate"))
            .arg("run")
            .arg(&file)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        let want = format!("{}:{line}: {key}: ", file.display());
        assert!(
            stderr.contains(&want),
            "want `{want}` ({what}) in: {stderr}"
        );
        assert!(stderr.contains(what), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "one error: {stderr}");
        let _ = std::fs::remove_file(&file);
    }
    let missing = "[decode]\nkind = \"image\"\n";
    let e = PipelineSpec::parse(missing, "m.toml").unwrap_err();
    assert!(e.to_string().contains("missing field `source`"), "{e}");
}

#[test]
fn gen_data_writes_the_lists() {
    let dir = std::env::temp_dir().join(format!("flowgate-gen-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_flowgate"))
        .args(["gen-data", "--images", "3", "--audio", "2", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let images = std::fs::read_to_string(dir.join("images.txt")).unwrap();
    let audio = std::fs::read_to_string(dir.join("audio.txt")).unwrap();
    assert_eq!((images.lines().count(), audio.lines().count()), (3, 2));
    assert!(Path::new(images.lines().next().unwrap()).exists());
    let _ = std::fs::remove_dir_all(dir);
}

/// `GET /metrics` over loopback with a plain socket (the client side of the exporter's HTTP).
#[cfg(feature = "prometheus")]
fn scrape(port: u16) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
        .ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

#[cfg(feature = "prometheus")]
#[test]
fn the_prometheus_endpoint_serves_the_documented_metrics() {
    use std::time::{Duration, Instant};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let text = config("image_classification.toml")
        .replace("epochs = 3", "epochs = 40")
        .replace("step_ms = 1.0", "step_ms = 40.0")
        + &format!("\n[metrics]\ninterval_ms = 100\nprometheus = \"127.0.0.1:{port}\"\n");
    let file = std::env::temp_dir().join(format!("flowgate-prom-{}.toml", std::process::id()));
    std::fs::write(&file, text).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_flowgate"))
        .args(["run", "--quiet"])
        .arg(&file)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let names = [
        "flowgate_delivered_total",
        "flowgate_failures_total",
        "flowgate_consumer_wait_seconds_total",
        "flowgate_epoch",
        "flowgate_stage_workers{stage=\"decode\"}",
        "flowgate_stage_items_in_total{stage=\"decode\"}",
        "flowgate_stage_items_out_total{stage=\"sink\"}",
        "flowgate_stage_failures_total",
        "flowgate_stage_queue_items",
        "flowgate_stage_queue_bytes",
        "flowgate_stage_budget_items",
        "flowgate_stage_busy_seconds_total",
        "flowgate_stage_blocked_put_seconds_total",
        "flowgate_stage_blocked_get_seconds_total",
        "flowgate_stage_task_p50_seconds",
        "flowgate_stage_task_p99_seconds",
    ];
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < Duration::from_secs(60) {
        if let Some(body) = scrape(port) {
            last = body;
            if names.iter().all(|n| last.contains(n)) {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&file);
    for n in names {
        assert!(last.contains(n), "{n} missing from:\n{last}");
    }
}

/// Every batch of a run of `epochs` epochs, as bytes.
fn batches(toml: &str, epochs: u64) -> Vec<Vec<u8>> {
    let spec = PipelineSpec::parse(toml, "t.toml").unwrap();
    let mut loader = spec.build(Hooks::default()).unwrap();
    let mut out = Vec::new();
    for _ in 0..epochs {
        for b in loader.pipeline.iter() {
            out.push(b.unwrap().bytes().to_vec());
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
                "[source]\nkind = \"list\"\npath = \"{}\"\n[decode]\n{decode}\nworkers = 1\ntrain = {train}\n[batch]\nsize = 64\n[run]\nepochs = 2\n[tuner]\nenabled = false\n",
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
