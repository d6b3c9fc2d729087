//! The `flowgate` command.
//!
//! ```text
//! flowgate run PIPELINE.toml                # run a pipeline file with a live view
//! flowgate profile PIPELINE.toml            # each stage alone at several concurrencies
//! flowgate gen-data --out DIR [--shards 100] # the sample dataset (and tar shards of it)
//! flowgate plot TRACE.jsonl -o tuner.svg    # draw a tuner decision trace
//! ```
//!
//! `RUST_LOG` sets the log filter (default `warn`); logs go to stderr.
//!
//! A trace comes from a pipeline built with `TunerSettings { trace: Some(path), .. }` (for
//! example `cargo run --release --example demo -- --trace trace.jsonl`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// `--version`: the version, the JPEG decoder and the features compiled in
/// (`flowgate::build_info`).
static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let info = flowgate::build_info().to_string();
    info.strip_prefix("flowgate ").unwrap_or(&info).to_owned()
});

#[derive(Parser, Debug)]
#[command(
    name = "flowgate",
    version = VERSION.as_str(),
    about = "A self-tuning data loading pipeline"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs a pipeline file, with a live view of every stage, then a summary.
    Run {
        /// The pipeline file (TOML; see `examples/configs/`).
        pipeline: PathBuf,
        /// No live view (the summary and the JSON line still print).
        #[arg(long)]
        quiet: bool,
        /// Write every batch into this folder as a NumPy file
        /// (`epoch{E}-batch{NNNNN}.npy`), to check what a pipeline file delivers.
        #[arg(long, value_name = "DIR")]
        dump: Option<PathBuf>,
    },
    /// Runs the decode (and fetch) stage alone over a sample at several concurrencies, predicts
    /// the bottleneck, then runs the tuned pipeline and compares.
    Profile {
        /// The pipeline file.
        pipeline: PathBuf,
        /// Items in the sample.
        #[arg(long, default_value_t = 200)]
        sample: usize,
        /// Concurrency levels to try (1..=1024).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        levels: Vec<usize>,
        /// Measurements per level (the median is reported, with the spread).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// The least seconds one measurement takes (passes over the sample repeat until then).
        #[arg(long, default_value_t = 1.0)]
        min_seconds: f64,
    },
    /// Writes the sample dataset (`flowgate::synth`).
    GenData {
        /// The folder.
        #[arg(long, default_value = "target/sample-data")]
        out: PathBuf,
        /// Photo-like JPEGs.
        #[arg(long, default_value_t = 600)]
        images: usize,
        /// Tonal 16 kHz clips.
        #[arg(long, default_value_t = 0)]
        audio: usize,
        /// `flac` or `wav`.
        #[arg(long, default_value = "flac")]
        audio_format: String,
        /// The clips' lengths: uniform between `LO,HI` seconds (e.g. `1,30` for
        /// length-aware batching).
        #[arg(long, value_delimiter = ',', default_value = "3,10", num_args = 1)]
        audio_seconds: Vec<f64>,
        /// MP4 clips (needs the `ffmpeg` command).
        #[arg(long, default_value_t = 0)]
        video: usize,
        /// Also write the images as WebDataset tar shards of this many samples
        /// (`shards/`, pattern in `shards.txt`).
        #[arg(long, default_value_t = 0)]
        shards: usize,
        /// Seeds everything.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Shows every flowgate loader of this user on the node, live: rank, items/s, the
    /// training loop's wait, workers and cores, memory against its budget, the bottleneck and
    /// failures; names each job's straggler. Reads the node's board: no configuration.
    Top {
        /// Print the board once and exit (the default when stdout is not a terminal).
        #[arg(long)]
        once: bool,
        /// Seconds between redraws.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
    },
    /// Draws a tuner trace: batches/s with the decisions, the consumer's wait, workers per
    /// stage and memory over time, epochs marked.
    Plot {
        /// The trace, one JSON record per tuner tick (`[tuner] trace` in a pipeline file).
        trace: PathBuf,
        /// The picture to write: `.svg` or `.png`.
        #[arg(short, long, default_value = "tuner.svg")]
        output: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(view::LogWriter::default)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    view::route_panics();
    let result = match cli.command {
        Command::Plot { trace, output } => plot::plot(&trace, &output),
        Command::Top { once, interval } => {
            top::top(once, Duration::from_secs_f64(interval.clamp(0.1, 3600.0)))
        }
        Command::Run {
            pipeline,
            quiet,
            dump,
        } => match run::run(&pipeline, quiet, dump.as_deref()) {
            Ok(code) => return code,
            Err(e) => Err(e),
        },
        Command::Profile {
            pipeline,
            sample,
            levels,
            repeats,
            min_seconds,
        } => profile::profile(
            &pipeline,
            &profile::Settings {
                sample,
                levels,
                repeats,
                min_seconds,
            },
        ),
        Command::GenData {
            out,
            images,
            audio,
            audio_format,
            audio_seconds,
            video,
            shards,
            seed,
        } => gen_data(flowgate::synth::DatasetSpec {
            out,
            images,
            audio,
            audio_seconds: match audio_seconds[..] {
                [lo, hi] if lo > 0.0 && hi >= lo && hi <= 3600.0 => (lo, hi),
                _ => {
                    eprintln!(
                        "flowgate: --audio-seconds: LO,HI with 0 < LO <= HI <= 3600, not {audio_seconds:?}"
                    );
                    return ExitCode::FAILURE;
                }
            },
            flac: match audio_format.as_str() {
                "flac" => true,
                "wav" => false,
                other => {
                    eprintln!("flowgate: --audio-format: flac or wav, not {other}");
                    return ExitCode::FAILURE;
                }
            },
            video,
            shards,
            seed,
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flowgate: {}", with_build_hint(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

/// A message naming a missing Cargo feature, with the command that builds it in.
fn with_build_hint(message: &str) -> String {
    const NEEDS: &str = "built with the `";
    let feature = message
        .find(NEEDS)
        .map(|i| &message[i + NEEDS.len()..])
        .and_then(|rest| rest.split('`').next());
    match feature {
        // `test-util` comes with the command's `s3` feature.
        Some(f) => {
            let f = if f == "test-util" { "s3" } else { f };
            format!("{message} (build the command with it: cargo build --release -p flowgate-cli --features {f})")
        }
        None => message.to_owned(),
    }
}

type Error = Box<dyn std::error::Error>;

#[cfg(feature = "prometheus")]
mod metrics;
mod plot;
mod profile;
mod rates;
mod run;
mod text;
mod top;
mod view;

fn gen_data(spec: flowgate::synth::DatasetSpec) -> Result<(), Error> {
    let started = std::time::Instant::now();
    // Progress on stderr: redrawn in place on a terminal, a line per kind and 10 s otherwise.
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut last = (String::new(), std::time::Instant::now());
    let out = flowgate::synth::write_dataset_with_progress(&spec, |kind, done, total| {
        let line = format!(
            "gen-data: {kind} {done}/{total} ({:.0}%) in {:.1} s",
            100.0 * done as f64 / total.max(1) as f64,
            started.elapsed().as_secs_f64()
        );
        if tty {
            eprint!("\r\x1b[K{line}");
            if done == total {
                eprintln!();
            }
        } else if last.0 != kind || done == total || last.1.elapsed().as_secs() >= 10 {
            eprintln!("{line}");
            last = (kind.to_owned(), std::time::Instant::now());
        }
    })?;
    println!(
        "wrote {} images, {} audio clips, {} video clips to {} in {:.1} s",
        spec.images,
        spec.audio,
        spec.video,
        out.display(),
        started.elapsed().as_secs_f64()
    );
    if spec.shards > 0 && spec.images > 0 {
        let pattern = std::fs::read_to_string(out.join("shards.txt"))?;
        println!(
            "and the images as tar shards of {}: {}",
            spec.shards,
            pattern.trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_missing_feature_comes_with_the_build_command() {
        let m = super::with_build_hint(
            "decode.kind = \"video\" needs flowgate built with the `video` feature",
        );
        assert!(
            m.ends_with("cargo build --release -p flowgate-cli --features video)"),
            "{m}"
        );
        let m = super::with_build_hint("x needs flowgate built with the `test-util` feature");
        assert!(m.ends_with("--features s3)"), "{m}");
        assert_eq!(
            super::with_build_hint("p.toml:3: batch.size: bad"),
            "p.toml:3: batch.size: bad"
        );
    }
}
