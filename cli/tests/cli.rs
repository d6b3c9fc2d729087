//! The `flowgate` command end to end: `run` prints decisions, a summary and a JSON line and
//! dumps batches, bad files give one error naming the key and line, `gen-data` writes the
//! lists, `plot` draws a tuner trace, and the Prometheus endpoint serves its metrics.

use std::path::Path;
use std::process::Command;

use flowgate::spec::PipelineSpec;

mod common;
use common::config;

#[test]
fn flowgate_run_prints_decisions_a_summary_and_json() {
    let file = std::env::temp_dir().join(format!("flowgate-run-{}.toml", std::process::id()));
    std::fs::write(&file, config("image_classification.toml")).unwrap();
    let dump = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-dump");
    let _ = std::fs::remove_dir_all(&dump);
    let out = Command::new(env!("CARGO_BIN_EXE_flowgate"))
        .arg("run")
        .arg(&file)
        .arg("--dump")
        .arg(&dump)
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
    // Every batch dumped: 40 images in batches of 32 (the last partial) for 3 epochs.
    let spec = PipelineSpec::parse(&config("image_classification.toml"), "c.toml").unwrap();
    let per_epoch = if spec.loader_settings().drop_last {
        1
    } else {
        2
    };
    let mut dumped: Vec<_> = std::fs::read_dir(&dump)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dumped.sort();
    assert_eq!(dumped.len(), 3 * per_epoch, "{dumped:?}");
    let first = std::fs::read(&dumped[0]).unwrap();
    assert!(first.starts_with(b"\x93NUMPY"), "a NumPy file");
    assert!(dumped[0].ends_with("epoch0-batch00000.npy"), "{dumped:?}");
    let _ = std::fs::remove_file(file);
}

#[test]
fn bad_files_give_one_error_naming_the_key_and_line() {
    let cases = [
        (
            "batch_size = 32",
            "batch_size = 32\nbatchsize = 3",
            "loader.batchsize",
            "unknown field",
        ),
        (
            "batch_size = 32",
            "batch_size = \"32\"",
            "loader.batch_size",
            "must be in 1..=65536, not \"32\"",
        ),
        ("crop = 224", "crop = 512", "decode.crop", "must be in"),
        ("epochs = 3", "epochs = 0", "run.epochs", "must be in 1..="),
        (
            "resize = 256",
            "resize = \"256\"",
            "decode.resize",
            "expected a whole number",
        ),
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
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("gen-data: images 3/3 (100%)") && stderr.contains("audio 2/2"),
        "progress: {stderr}"
    );
    let _ = std::fs::remove_dir_all(dir);
    // An error names the path.
    let out = Command::new(env!("CARGO_BIN_EXE_flowgate"))
        .args([
            "gen-data",
            "--images",
            "1",
            "--out",
            "/proc/flowgate-cannot-write-here",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/proc/flowgate-cannot-write-here"),
        "{stderr}"
    );
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
        .env("RANK", "2")
        .env("LOCAL_RANK", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Every series carries the rank's labels (global labels, in whatever order).
    let labelled = |body: &str, name: &str| {
        let (metric, wanted) = name.split_once('{').unwrap_or((name, ""));
        body.lines().any(|l| {
            l.starts_with(metric)
                && l.contains("rank=\"2\"")
                && l.contains("local_rank=\"1\"")
                && wanted
                    .trim_end_matches('}')
                    .split(',')
                    .all(|w| w.is_empty() || l.contains(w))
        })
    };
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
            if names.iter().all(|n| labelled(&last, n)) {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&file);
    for n in names {
        assert!(
            labelled(&last, n),
            "{n} (with the rank's labels) missing from:\n{last}"
        );
    }
}

#[test]
fn flowgate_plot_draws_a_trace_and_names_bad_lines() {
    let dir = std::env::temp_dir().join(format!("flowgate-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("tuner.svg");
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/demo-trace.jsonl");
    let plot = |trace: &std::path::Path, out: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_flowgate"))
            .arg("plot")
            .arg(trace)
            .arg("-o")
            .arg(out)
            .output()
            .unwrap()
    };
    let trace = std::path::Path::new(trace);
    let out = plot(trace, &svg);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let picture = std::fs::read_to_string(&svg).unwrap();
    for text in [
        "delivered per second, over 2 s",
        "training loop waiting",
        "workers per stage",
        "memory, MiB",
        "decode",
        "1. @0.4s read → 47 workers",
    ] {
        assert!(picture.contains(text), "the picture lacks {text:?}");
    }
    // A trace that carries epochs (as a pipeline's tuner writes it) marks their boundaries.
    let with_epochs: String = std::fs::read_to_string(trace)
        .unwrap()
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["epoch"] = serde_json::json!(i / 40);
            format!("{v}\n")
        })
        .collect();
    let epochs = dir.join("epochs.jsonl");
    std::fs::write(&epochs, with_epochs).unwrap();
    let out = plot(&epochs, &svg);
    assert!(out.status.success());
    let picture = std::fs::read_to_string(&svg).unwrap();
    // Numbered as the run's summary numbers them: the first boundary starts epoch 2.
    assert!(picture.contains("epoch 2") && picture.contains("epoch 3"));
    assert!(!picture.contains("epoch 1<") && !picture.contains(">epoch 1 "));
    // Each decision's dot names its knob.
    assert!(picture.contains("1 workers"), "a dot without its knob");
    let png = dir.join("tuner.png");
    let out = plot(trace, &png);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 10_000);
    let bad = dir.join("bad.jsonl");
    let first = std::fs::read_to_string(trace)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_owned();
    std::fs::write(&bad, format!("{first}\n{{\"t\": \"soon\"}}\n")).unwrap();
    let out = plot(&bad, &dir.join("x.svg"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.jsonl:2:"), "{err}");
    // A place the picture cannot go: one sentence naming it, not the backend's debug dump.
    let out = plot(trace, &dir.join("no-such-folder/t.png"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot write the plot to") && err.contains("no-such-folder/t.png"),
        "{err}"
    );
    assert!(
        !err.contains("ImageError") && !err.contains("Os {"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A pipeline file over tar shards on S3: the local S3 server serves the sample shards and
/// their manifest, `flowgate run` reads them through its disk cache (credentials from the
/// environment, as on a training machine).
#[cfg(feature = "s3")]
#[test]
fn flowgate_run_reads_tar_shards_from_s3() {
    use flowgate::s3::{LocalServer, S3};
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-s3-shards");
    let _ = std::fs::remove_dir_all(&root);
    let server = LocalServer::start(root.join("server")).expect("start s3s-fs");
    let s3 = S3::connect(server.config("data")).unwrap();
    futures::executor::block_on(s3.create_bucket()).unwrap();
    let mut uploaded = 0;
    for entry in std::fs::read_dir(common::dataset().join("shards")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).unwrap();
        futures::executor::block_on(s3.put(&format!("corpus/{name}"), bytes)).unwrap();
        uploaded += 1;
    }
    assert!(uploaded >= 2, "shards and their manifest");
    let text = config("shards.toml").replace(
        &format!("shards = \"{}/shards\"", common::dataset().display()),
        &format!(
            "shards = \"s3://data/corpus/\"\nendpoint = \"{}\"\ncache_dir = \"{}\"\ncache_mb = 64",
            server.endpoint(),
            root.join("cache").display()
        ),
    );
    assert!(text.contains("s3://data/corpus/"), "{text}");
    let file = root.join("s3-shards.toml");
    std::fs::write(&file, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_flowgate"))
        .arg("run")
        .arg(&file)
        .env("AWS_ACCESS_KEY_ID", LocalServer::ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", LocalServer::SECRET_KEY)
        .env("AWS_REGION", "us-east-1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let json: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap()).expect("a JSON last line");
    assert_eq!(json["items"], 120, "40 images, 3 epochs: {stdout}");
    assert_eq!(json["failures"], 0);
    let cached = std::fs::read_dir(root.join("cache/data/corpus"))
        .unwrap()
        .count();
    assert!(cached >= 1, "the shards went through the disk cache");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn version_names_the_decoders_and_features_built_in() {
    let out = Command::new(env!("CARGO_BIN_EXE_flowgate"))
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.starts_with(&format!("flowgate {}", env!("CARGO_PKG_VERSION")))
            && text.contains("jpeg: ")
            && text.contains("features: ")
            && text.contains("spec"),
        "{text}"
    );
}

/// `[fields]` in a pipeline file: a sample's other members read beside its image, dumped per
/// batch as JSON lines aligned with the labels (each record names its own image); a bad
/// field is one error naming `fields.NAME` and its line.
#[test]
fn pipeline_files_read_fields_besides_the_media_and_dump_them_aligned() {
    let data = common::dataset();
    let text = format!(
        "[source]\nkind = \"tar\"\nshards = \"{}\"\nlabels = \"cls\"\nbuffer = 9\n\
         [loader]\nseed = 3\nbatch_size = 7\n\
         [fields]\nmeta = \"json\"\nraw = {{ from = \"cls\", kind = \"bytes\" }}\n\
         [decode]\nkind = \"image\"\nresize = 32\ncrop = 32\n\
         [run]\nepochs = 1\n[tuner]\nenabled = false\n",
        data.join("shards").display()
    );
    let file = std::env::temp_dir().join(format!("flowgate-fields-{}.toml", std::process::id()));
    std::fs::write(&file, &text).unwrap();
    let dump = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-fields-dump");
    let _ = std::fs::remove_dir_all(&dump);
    let out = Command::new(env!("CARGO_BIN_EXE_flowgate"))
        .args(["run", "--quiet"])
        .arg(&file)
        .arg("--dump")
        .arg(&dump)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let images: Vec<String> = std::fs::read_to_string(data.join("images.txt"))
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let mut seen = Vec::new();
    for b in 0..images.len().div_ceil(7) {
        let lines =
            std::fs::read_to_string(dump.join(format!("epoch0-batch{b:05}-fields.jsonl"))).unwrap();
        let npy = std::fs::read(dump.join(format!("epoch0-batch{b:05}-labels.npy"))).unwrap();
        let header = 10 + u16::from_le_bytes([npy[8], npy[9]]) as usize;
        let labels: Vec<i64> = npy[header..]
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let rows: Vec<serde_json::Value> = lines
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), labels.len());
        for (row, label) in rows.iter().zip(&labels) {
            let hex = row["raw"].as_str().unwrap();
            let raw: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            assert_eq!(String::from_utf8(raw).unwrap(), label.to_string());
            assert_eq!(row["meta"]["path"], images[*label as usize], "{row}");
            seen.push(*label);
        }
    }
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..images.len() as i64).collect::<Vec<_>>(),
        "every sample once"
    );

    let bad = text.replace("meta = \"json\"", "meta = 3");
    std::fs::write(&file, &bad).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_flowgate"))
        .arg("run")
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = bad.lines().position(|l| l == "meta = 3").unwrap() + 1;
    assert!(
        stderr.contains(&format!("{}:{line}: fields.meta: ", file.display())),
        "{stderr}"
    );
    let _ = std::fs::remove_file(&file);
}
