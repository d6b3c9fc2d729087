//! The `flowgate` command.
//!
//! ```text
//! flowgate plot TRACE.jsonl -o tuner.svg    # draw a tuner decision trace
//! ```
//!
//! A trace comes from a pipeline built with `TunerSettings { trace: Some(path), .. }` (for
//! example `cargo run --release --example demo -- --trace trace.jsonl`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use flowgate::TraceRecord;
use plotters::prelude::*;

#[derive(Parser, Debug)]
#[command(
    name = "flowgate",
    version,
    about = "A self-tuning data loading pipeline"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Draws a tuner trace: throughput, workers per stage and buffered bytes over time.
    Plot {
        /// The trace, one JSON record per tuner tick.
        trace: PathBuf,
        /// The picture to write (SVG).
        #[arg(short, long, default_value = "tuner.svg")]
        output: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plot { trace, output } => plot(&trace, &output),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flowgate: {e}");
            ExitCode::FAILURE
        }
    }
}

type Error = Box<dyn std::error::Error>;

fn read_trace(path: &Path) -> Result<Vec<TraceRecord>, Error> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| format!("{}:{}: {e}", path.display(), i + 1).into())
        })
        .collect()
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn plot(trace: &Path, output: &Path) -> Result<(), Error> {
    if output.extension().and_then(|e| e.to_str()) != Some("svg") {
        // A bitmap needs a font to draw text with, which this binary does not carry; convert
        // the SVG instead (for example `rsvg-convert tuner.svg -o tuner.png`).
        return Err(format!("{}: write .svg (convert it for a bitmap)", output.display()).into());
    }
    let recs = read_trace(trace)?;
    let (Some(first), Some(last)) = (recs.first(), recs.last()) else {
        return Err(format!("{}: the trace is empty", trace.display()).into());
    };
    let t_end = last.t.max(first.t + 0.1);
    let root = SVGBackend::new(output, (960, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((3, 1));

    // Throughput, with the decisions marked.
    let max_rate = recs.iter().map(|r| r.rate).fold(1.0, f64::max) * 1.1;
    let mut c = ChartBuilder::on(&panels[0])
        .caption(
            "results per second (dots: tuner decisions)",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(first.t..t_end, 0.0..max_rate)?;
    c.configure_mesh().x_desc("seconds").draw()?;
    c.draw_series(LineSeries::new(
        recs.iter().map(|r| (r.t, r.rate)),
        &PALETTE[0],
    ))?;
    c.draw_series(
        recs.iter()
            .filter(|r| !r.decisions.is_empty())
            .map(|r| Circle::new((r.t, r.rate), 3, PALETTE[3].filled())),
    )?;

    // Workers per stage (log scale: async stages run hundreds, CPU stages a few).
    let max_w = recs
        .iter()
        .flat_map(|r| r.workers.iter().copied())
        .max()
        .unwrap_or(1) as f64;
    let mut c = ChartBuilder::on(&panels[1])
        .caption("workers per stage", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(first.t..t_end, (0.8..max_w * 1.5).log_scale())?;
    c.configure_mesh().x_desc("seconds").draw()?;
    for (i, name) in first.stages.iter().enumerate() {
        if name == "sink" {
            continue;
        }
        let color = PALETTE[i % PALETTE.len()];
        c.draw_series(LineSeries::new(
            recs.iter()
                .filter_map(|r| r.workers.get(i).map(|&w| (r.t, w as f64))),
            &color,
        ))?
        .label(name.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    c.configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;

    // Buffered bytes.
    let max_b = recs
        .iter()
        .map(|r| r.buffered_bytes)
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.1;
    let mut c = ChartBuilder::on(&panels[2])
        .caption(
            format!(
                "buffered bytes (memory budget {:.1} GiB)",
                last.memory_budget as f64 / (1u64 << 30) as f64
            ),
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(first.t..t_end, 0.0..max_b)?;
    c.configure_mesh().x_desc("seconds").draw()?;
    c.draw_series(LineSeries::new(
        recs.iter().map(|r| (r.t, r.buffered_bytes as f64)),
        &PALETTE[2],
    ))?;
    root.present()?;
    println!(
        "wrote {} ({} ticks, {} with decisions)",
        output.display(),
        recs.len(),
        recs.iter().filter(|r| !r.decisions.is_empty()).count()
    );
    Ok(())
}
