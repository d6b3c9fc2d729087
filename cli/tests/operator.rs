//! `flowgate run` as an operator meets it: exit codes a scheduler can trust (nothing
//! delivered, a failure budget exceeded, Ctrl-C), any file name from a list, sample configs
//! that run from any directory, and a live view that fits the terminal (checked on the screen
//! of a pseudo-terminal 80 columns wide) or, in a log, stays a few lines.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{assert_succeeded, configs, dataset, images, json, scratch};

fn flowgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flowgate"))
}

/// `flowgate run --quiet FILE`, run to its end.
fn run_quiet(file: &Path) -> Output {
    flowgate()
        .args(["run", "--quiet"])
        .arg(file)
        .output()
        .unwrap()
}

/// A pipeline file over `list` in `dir`, with `extra` appended.
fn pipeline(dir: &Path, list: &str, extra: &str) -> PathBuf {
    let file = dir.join("p.toml");
    std::fs::write(
        &file,
        format!(
            "[source]\nkind = \"list\"\npath = \"{list}\"\n[decode]\nkind = \"image\"\n\
             resize = 64\ncrop = 56\n[loader]\nbatch_size = 8\n{extra}"
        ),
    )
    .unwrap();
    file
}

#[test]
fn exit_codes_say_whether_the_run_delivered() {
    let dir = scratch("exit-codes");
    // Every path missing: nothing delivered is a failure, not a quiet 0.
    let missing: String = (0..50).map(|i| format!("gone/{i}.jpg\n")).collect();
    std::fs::write(dir.join("missing.txt"), missing).unwrap();
    let out = run_quiet(&pipeline(&dir, "missing.txt", ""));
    assert_eq!(out.status.code(), Some(1));
    let j = json(&out);
    assert_eq!(
        (j["status"].as_str(), j["failures"].as_u64()),
        (Some("empty"), Some(50))
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The library's words, as the Python loaders raise them (epochs count from 0).
    assert!(
        stderr.contains("epoch 0 delivered nothing: every item failed (50 failed items); last:"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("50 failed: reading …: No such file"),
        "failures grouped by reason: {stdout}"
    );

    // A few missing among good files: fine by default, fatal past `run.max_failures`.
    let mut list: Vec<String> = images().iter().map(|p| p.display().to_string()).collect();
    list.extend((0..4).map(|i| format!("gone/{i}.jpg")));
    std::fs::write(dir.join("mixed.txt"), list.join("\n")).unwrap();
    let out = run_quiet(&pipeline(&dir, "mixed.txt", ""));
    assert_succeeded(&out);
    assert_eq!(json(&out)["items"], 40);
    let out = run_quiet(&pipeline(&dir, "mixed.txt", "[run]\nmax_failures = 2\n"));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(json(&out)["status"], "failed");
    assert!(String::from_utf8_lossy(&out.stderr).contains("failure budget"));

    // A file name that is not UTF-8, from a list.
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let name = std::ffi::OsStr::from_bytes(b"caf\xe9.jpg");
        std::fs::copy(&images()[0], dir.join(name)).unwrap();
        let mut list = name.as_bytes().to_vec();
        list.push(b'\n');
        std::fs::write(dir.join("latin1.txt"), list).unwrap();
        let out = run_quiet(&pipeline(&dir, "latin1.txt", ""));
        assert_succeeded(&out);
        assert_eq!(
            (
                json(&out)["items"].as_u64(),
                json(&out)["failures"].as_u64()
            ),
            (Some(1), Some(0))
        );
    }
}

/// Ctrl-C, SIGTERM (what a scheduler sends before preemption) and SIGHUP stop a run the same
/// way: after the batch in hand, with the summary, the JSON line and exit 128 + the signal.
#[test]
fn ctrl_c_sigterm_and_sighup_stop_with_a_summary_and_128_plus_the_signal() {
    let dir = scratch("ctrl-c");
    let list: Vec<String> = images().iter().map(|p| p.display().to_string()).collect();
    std::fs::write(dir.join("list.txt"), list.join("\n")).unwrap();
    let file = pipeline(&dir, "list.txt", "[run]\nepochs = 1000\nstep_ms = 20\n");
    for (signal, code, name) in [
        (libc::SIGINT, 130, "SIGINT"),
        (libc::SIGTERM, 143, "SIGTERM"),
        (libc::SIGHUP, 129, "SIGHUP"),
    ] {
        let child = flowgate()
            .args(["run", "--quiet"])
            .arg(&file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_secs(3));
        // SAFETY: kill() on our own child.
        unsafe {
            libc::kill(child.id() as libc::pid_t, signal);
        }
        let t0 = Instant::now();
        let out = child.wait_with_output().unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{name}: stopped promptly"
        );
        assert_eq!(
            out.status.code(),
            Some(code),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j = json(&out);
        assert_eq!(j["status"], "interrupted", "{name}");
        assert!(j["error"].as_str().unwrap().contains(name), "{name}: {j}");
        assert!(j["items"].as_u64().unwrap() > 0, "{name}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("delivered"),
            "{name}"
        );
    }
}

#[test]
fn a_sample_config_runs_from_any_directory() {
    // The config in a tree shaped like the repository (`examples/configs/` two levels below
    // the root holding `target/sample-data`), run from elsewhere: its paths are the file's.
    let root = scratch("any-dir");
    std::fs::create_dir_all(root.join("examples/configs")).unwrap();
    std::fs::create_dir_all(root.join("target")).unwrap();
    std::os::unix::fs::symlink(dataset(), root.join("target/sample-data")).unwrap();
    let file = root.join("examples/configs/image_classification.toml");
    std::fs::copy(configs().join("image_classification.toml"), &file).unwrap();
    let out = flowgate()
        .args(["run", "--quiet"])
        .arg(&file)
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert_succeeded(&out);
    assert_eq!(json(&out)["items"], 120);
}

#[test]
fn off_a_terminal_progress_is_a_line_per_interval() {
    // About 20 s of run (40 epochs of 10 batches, a 25 ms step each, and the decoding of a
    // debug build): at the default 10 s interval, a few progress lines (the first after half
    // a second, the last at the end), not a block every half second.
    let dir = scratch("log-lines");
    let list: Vec<String> = images().iter().map(|p| p.display().to_string()).collect();
    std::fs::write(dir.join("list.txt"), list.join("\n")).unwrap();
    let text = std::fs::read_to_string(pipeline(&dir, "list.txt", "")).unwrap();
    let file = dir.join("p.toml");
    std::fs::write(
        &file,
        text.replace("size = 8", "size = 4") + "[run]\nepochs = 40\nstep_ms = 25\n",
    )
    .unwrap();
    let t0 = Instant::now();
    let out = flowgate().arg("run").arg(&file).output().unwrap();
    let secs = t0.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let progress: Vec<&str> = stderr.lines().filter(|l| l.starts_with('[')).collect();
    // One at the start, one per 10 s, one at the end (the run takes longer on a loaded
    // machine: the bound follows the time it took).
    let most = (secs / 10.0).floor() as usize + 2;
    assert!(
        !progress.is_empty() && progress.len() <= most,
        "{} progress lines in {secs:.0} s (at most {most}):\n{stderr}",
        progress.len()
    );
    let last = progress.last().unwrap();
    assert!(
        last.contains("epoch") && last.contains("ETA") && last.contains("batches/s"),
        "{last}"
    );
    let tuner = stderr.lines().filter(|l| l.starts_with("tuner")).count();
    assert!(
        stderr.lines().count() <= progress.len() + tuner + 2,
        "{stderr}"
    );
}

/// Runs `flowgate run FILE` with stderr on a pseudo-terminal `cols` wide and returns every
/// screen a terminal would have shown (one per chunk read).
fn run_on_a_terminal(
    file: &Path,
    cols: u16,
    rows: u16,
) -> (std::process::ExitStatus, Vec<Screen>, String) {
    let (mut reader, slave) = common::pty(cols, rows);
    let mut child = flowgate()
        .arg("run")
        .arg(file)
        .stdout(Stdio::piped())
        .stderr(slave)
        .spawn()
        .unwrap();
    // The summary (stdout) is read on its own thread: a full pipe would stall the run.
    let mut out = child.stdout.take().unwrap();
    let summary = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let mut parser = vt100::Parser::new(rows, cols, 0);
    let mut screens = Vec::new();
    let mut buf = [0u8; 4096];
    // Reads until the child has exited and closed the terminal (EIO).
    while let Ok(n @ 1..) = reader.read(&mut buf) {
        parser.process(&buf[..n]);
        let s = parser.screen();
        screens.push(Screen {
            rows: s.rows(0, cols).collect(),
            wrapped: (0..rows)
                .filter(|&r| s.row_wrapped(r))
                .map(usize::from)
                .collect(),
        });
    }
    (child.wait().unwrap(), screens, summary.join().unwrap())
}

/// The items/s the frames showed (their rate line), from the screens after the first
/// quarter (the start-up), and the run's own figure from its JSON summary.
fn shown_and_summary_rates(screens: &[Screen], stdout: &str) -> (Vec<f64>, f64) {
    let shown: Vec<f64> = screens[screens.len() / 4..]
        .iter()
        .filter_map(|s| {
            let line = s.rows.iter().find(|r| r.contains("batches/s, "))?;
            let at = line.find(" items/s")?;
            line[..at].rsplit(' ').next()?.parse().ok()
        })
        .collect();
    let json: serde_json::Value = stdout
        .lines()
        .rfind(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .expect("the JSON summary");
    (shown, json["items_per_s"].as_f64().unwrap())
}

/// The items/s a steady run's frames show are the run's: the median of what they showed
/// within 25% of the summary's figure (rates over one redraw's interval read 0 while
/// decode works in bursts).
fn assert_shown_rate_is_the_runs(screens: &[Screen], stdout: &str) {
    let (mut shown, summary) = shown_and_summary_rates(screens, stdout);
    assert!(shown.len() > 3, "{} rate lines", shown.len());
    shown.sort_by(f64::total_cmp);
    let median = shown[shown.len() / 2];
    assert!(
        (median - summary).abs() <= 0.25 * summary,
        "shown {median:.0} items/s (of {shown:?}), the summary {summary:.0}"
    );
}

/// A pipeline file over `list` for the terminal tests: batches of 4, 12 epochs, a 25 ms
/// step (long enough for many redraws).
fn terminal_pipeline(dir: &Path, list: &[String]) -> PathBuf {
    std::fs::write(dir.join("list.txt"), list.join("\n")).unwrap();
    let text = std::fs::read_to_string(pipeline(dir, "list.txt", "")).unwrap();
    let file = dir.join("p.toml");
    std::fs::write(
        &file,
        text.replace("size = 8", "size = 4") + "[run]\nepochs = 12\nstep_ms = 25\n",
    )
    .unwrap();
    file
}

/// A terminal's screen: its rows, and which of them wrapped onto the next.
struct Screen {
    rows: Vec<String>,
    wrapped: Vec<usize>,
}

#[test]
fn the_live_view_fits_an_80_column_terminal() {
    let dir = scratch("pty");
    let list: Vec<String> = images().iter().map(|p| p.display().to_string()).collect();
    // Two missing files: the failures line, with a long reason, must not wrap either.
    let mut list = list;
    list.push(format!(
        "{}/{}/gone.jpg",
        dir.display(),
        "a-long-folder-name".repeat(4)
    ));
    list.push(format!("{}/gone-too.jpg", dir.display()));
    let file = terminal_pipeline(&dir, &list);
    let (status, screens, stdout) = run_on_a_terminal(&file, 80, 24);
    assert!(status.success());
    assert_shown_rate_is_the_runs(&screens, &stdout);
    assert!(screens.len() > 5, "{} screens", screens.len());
    let mut with_eta = 0;
    for (i, s) in screens.iter().enumerate() {
        let text = s.rows.join("\n");
        // The frame is the screen's last block, from its `epoch` line down; log lines above
        // it (the run's first line, tuner decisions) may wrap: they are printed once.
        if let Some(top) = s.rows.iter().position(|r| r.starts_with("epoch ")) {
            let wrapped = s.wrapped.iter().filter(|&&r| r >= top).count();
            assert_eq!(wrapped, 0, "screen {i}: a frame line wrapped:\n{text}");
        }
        // One frame on screen at a time: its first line and its table header once at most.
        let frames = s.rows.iter().filter(|r| r.starts_with("epoch ")).count();
        let headers = s
            .rows
            .iter()
            .filter(|r| r.trim_start().starts_with("stage "))
            .count();
        assert!(
            frames <= 1 && headers <= 1,
            "screen {i}: a stale frame:\n{text}"
        );
        if s.rows
            .iter()
            .any(|r| r.contains("ETA") && r.contains("items"))
        {
            with_eta += 1;
        }
    }
    assert!(
        with_eta > 3,
        "progress with ETA on {with_eta} of {} screens; the last:\n{}",
        screens.len(),
        screens.last().unwrap().rows.join("\n")
    );
    let last = screens.last().unwrap().rows.join("\n");
    assert!(last.contains("failures 2"), "{last}");
    assert!(last.contains("rss") && last.contains("cores"), "{last}");
}

/// At 50×8 the frame is cut to the terminal's height as well as its width: its first lines
/// (the epoch and its progress, the rates) stay on screen, one frame at a time, none wrapped.
#[test]
fn the_live_view_fits_a_50_by_8_terminal() {
    let dir = scratch("pty-small");
    let list: Vec<String> = images().iter().map(|p| p.display().to_string()).collect();
    let file = terminal_pipeline(&dir, &list);
    let (status, screens, stdout) = run_on_a_terminal(&file, 50, 8);
    assert!(status.success());
    assert_shown_rate_is_the_runs(&screens, &stdout);
    let mut whole_frames = 0;
    for (i, s) in screens.iter().enumerate() {
        let text = s.rows.join("\n");
        let Some(top) = s.rows.iter().position(|r| r.starts_with("epoch ")) else {
            continue;
        };
        let frames = s.rows.iter().filter(|r| r.starts_with("epoch ")).count();
        assert_eq!(frames, 1, "screen {i}: a stale frame:\n{text}");
        let wrapped = s.wrapped.iter().filter(|&&r| r >= top).count();
        assert_eq!(wrapped, 0, "screen {i}: a frame line wrapped:\n{text}");
        if s.rows.get(top + 1).is_some_and(|r| r.contains("batches/s")) {
            whole_frames += 1;
        }
    }
    assert!(
        whole_frames > 3,
        "the progress and rate lines on {whole_frames} screens"
    );
}

/// `flowgate profile` of `file` at 1 and 2 workers, twice each, 0.2 s a measurement.
fn profile_levels(file: &Path) -> Output {
    flowgate()
        .args([
            "profile",
            "--levels",
            "1,2",
            "--repeats",
            "2",
            "--min-seconds",
            "0.2",
        ])
        .arg(file)
        .output()
        .unwrap()
}

#[test]
fn profile_measures_with_a_spread_and_refuses_what_it_cannot_measure() {
    let dir = scratch("profile");
    let list: Vec<String> = images().iter().map(|p| p.display().to_string()).collect();
    std::fs::write(dir.join("list.txt"), list.join("\n")).unwrap();
    let file = pipeline(&dir, "list.txt", "");
    let out = profile_levels(&file);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("spread (min-max)") && stdout.contains("predicted:"),
        "{stdout}"
    );
    assert!(stdout.contains("tuner ("), "{stdout}");

    // Bad files are counted once, however many passes, levels and repeats decode them.
    let mut with_bad = list.clone();
    for i in 0..7 {
        let bad = dir.join(format!("bad{i}.jpg"));
        std::fs::write(&bad, b"not a jpeg").unwrap();
        with_bad.push(bad.display().to_string());
    }
    std::fs::write(dir.join("with_bad.txt"), with_bad.join("\n")).unwrap();
    let out = profile_levels(&pipeline(&dir, "with_bad.txt", ""));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("7 item(s) failed to decode"), "{stdout}");

    let missing: String = (0..20).map(|i| format!("gone/{i}.jpg\n")).collect();
    std::fs::write(dir.join("missing.txt"), missing).unwrap();
    let out = flowgate()
        .args(["profile", "--min-seconds", "0.2"])
        .arg(pipeline(&dir, "missing.txt", ""))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("every item failed"));

    for bad in [
        ["--levels", "0"],
        ["--repeats", "0"],
        ["--min-seconds", "0"],
    ] {
        let out = flowgate()
            .arg("profile")
            .args(bad)
            .arg(&file)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{bad:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(bad[0]), "{bad:?}: {stderr}");
    }
}

/// A piped run's last progress line agrees with its summary: items delivered, items failed
/// (counted as processed: 100%), and the failures total.
#[test]
fn a_piped_runs_last_progress_line_agrees_with_the_summary() {
    let dir = scratch("last-line");
    let mut list: Vec<String> = images()
        .iter()
        .take(20)
        .map(|p| p.display().to_string())
        .collect();
    for i in 0..3 {
        let bad = dir.join(format!("bad{i}.jpg"));
        std::fs::write(&bad, b"not a jpeg").unwrap();
        list.push(bad.display().to_string());
    }
    std::fs::write(dir.join("list.txt"), list.join("\n")).unwrap();
    let out = flowgate()
        .arg("run")
        .arg(pipeline(&dir, "list.txt", "[run]\nprogress_s = 0.1\n"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_succeeded(&out);
    let j = json(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr
        .lines()
        .rfind(|l| l.starts_with('[') && l.contains(" items"))
        .unwrap_or_else(|| panic!("no progress line: {stderr}"));
    let (items, failures) = (
        j["items"].as_u64().unwrap(),
        j["failures"].as_u64().unwrap(),
    );
    assert_eq!((items, failures), (20, 3));
    assert!(
        last.contains(&format!("{items}/23 items + {failures} failed (100%)"))
            && last.ends_with(&format!("failures {failures}")),
        "{last}"
    );
}
