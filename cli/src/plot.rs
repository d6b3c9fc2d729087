//! `flowgate plot`: a tuner trace as a picture (SVG or PNG), one panel per signal: results/s
//! (batches when the pipeline batches; averaged over the live view's 2-s window, each tick
//! faint behind it) with the tuner's decisions numbered, marked with their knob and listed,
//! the consumer's wait (averaged alike), workers per stage (integer axis; each stage in its
//! own colour and dash), and memory (buffered bytes, RSS and the budget, in MiB). Epoch
//! boundaries are marked in every panel and numbered from 1, as the run's summary numbers
//! them.

use std::path::{Path, PathBuf};

use flowgate::TraceRecord;
use plotters::coord::Shift;
use plotters::prelude::*;

type Error = Box<dyn std::error::Error>;

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];
const GREY: RGBColor = RGBColor(150, 150, 150);
/// Decisions listed under the picture (the rest are counted).
const LISTED: usize = 14;

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

/// Draws `trace` into `output` (`.svg` or `.png`).
pub(crate) fn plot(trace: &Path, output: &Path) -> Result<(), Error> {
    let recs = read_trace(trace)?;
    if recs.is_empty() {
        return Err(format!("{}: the trace is empty", trace.display()).into());
    }
    let ext = output.extension().and_then(|e| e.to_str());
    if !matches!(ext, Some("svg" | "png")) {
        return Err(format!("{}: write .svg or .png", output.display()).into());
    }
    // The drawing backends report a bad path as a nested debug dump: try the file first.
    std::fs::File::create(output)
        .map_err(|e| format!("cannot write the plot to {}: {e}", output.display()))?;
    // Text is laid out with a TrueType font: DejaVu Sans, which scripts/setup.sh installs
    // (fonts-dejavu-core), or $FLOWGATE_FONT.
    let font = std::env::var_os("FLOWGATE_FONT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"));
    let bytes = std::fs::read(&font).map_err(|e| {
        format!(
            "the plot needs a TrueType font: {}: {e} (install fonts-dejavu-core or set FLOWGATE_FONT)",
            font.display()
        )
    })?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    let drawn =
        |e: Error| -> Error { format!("drawing the plot into {}: {e}", output.display()).into() };
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| format!("{}: not a usable font", font.display()))?;
    let size = (1000, 1180);
    if ext == Some("svg") {
        draw(SVGBackend::new(output, size).into_drawing_area(), &recs).map_err(drawn)?;
    } else {
        draw(BitMapBackend::new(output, size).into_drawing_area(), &recs).map_err(drawn)?;
    }
    let decisions: usize = recs.iter().map(|r| r.decisions.len()).sum();
    println!(
        "wrote {} ({} ticks over {:.1} s, {decisions} decisions)",
        output.display(),
        recs.len(),
        recs[recs.len() - 1].t - recs[0].t
    );
    Ok(())
}

/// The times the epoch changed, with the new epoch (from traces that carry epochs).
fn epoch_marks(recs: &[TraceRecord]) -> Vec<(f64, u64)> {
    recs.windows(2)
        .filter_map(|w| match (w[0].epoch, w[1].epoch) {
            (Some(a), Some(b)) if b != a => Some((w[1].t, b)),
            _ => None,
        })
        .collect()
}

/// The seconds the rate and wait panels average over: the live view's window.
const WINDOW_S: f64 = 2.0;

/// `f` of each record averaged over the `WINDOW_S` before it (a tick's rate counts the
/// batches that finished in its 100 ms: a comb between 0 and a burst).
fn smoothed(recs: &[TraceRecord], f: impl Fn(&TraceRecord) -> f64) -> Vec<(f64, f64)> {
    let mut from = 0;
    let mut sum = 0.0;
    let mut out = Vec::with_capacity(recs.len());
    for (i, r) in recs.iter().enumerate() {
        sum += f(r);
        while recs[from].t < r.t - WINDOW_S && from < i {
            sum -= f(&recs[from]);
            from += 1;
        }
        out.push((r.t, sum / (i + 1 - from) as f64));
    }
    out
}

/// The knob a decision turns, in a word (marked on the rate panel).
fn knob(d: &flowgate::tuner::Decision) -> &'static str {
    use flowgate::tuner::Action;
    match d.action {
        Action::SetWorkers { .. } => "workers",
        Action::SetPrefetch { .. } => "queue",
        Action::SetCacheBytes { .. } => "cache",
        Action::SetReadAhead { .. } => "read-ahead",
        Action::SetItemThreads { .. } => "threads",
    }
}

/// A decision in few words, for the list under the picture.
fn short(d: &flowgate::tuner::Decision, stages: &[String]) -> String {
    use flowgate::tuner::Action;
    let name = |i: usize| stages.get(i).map_or("?", String::as_str);
    match d.action {
        Action::SetWorkers { stage, workers } => format!("{} → {workers} workers", name(stage)),
        Action::SetPrefetch { stage, items, .. } => {
            format!("{} queue → {items} items", name(stage))
        }
        Action::SetCacheBytes { stage, bytes } => {
            format!("{} cache → {:.0} MiB", name(stage), bytes as f64 / MIB)
        }
        Action::SetReadAhead { stage, depth } => {
            format!("{} read-ahead → {depth} shards", name(stage))
        }
        Action::SetItemThreads { stage, threads } => {
            format!("{} → {threads} threads per item", name(stage))
        }
    }
}

const MIB: f64 = 1048576.0;

/// The panels of a trace on `root`.
fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, recs: &[TraceRecord]) -> Result<(), Error>
where
    DB::ErrorType: 'static,
{
    let (first, last) = (&recs[0], &recs[recs.len() - 1]);
    let t0 = first.t;
    let t1 = last.t.max(first.t + 0.1);
    // Many short epochs: every k-th marked and numbered (at most about ten), so the labels
    // stay legible.
    let epochs: Vec<(f64, u64)> = {
        let all = epoch_marks(recs);
        let every = all.len().div_ceil(10).max(1);
        all.into_iter()
            .filter(|&(_, e)| (e as usize) % every == 0)
            .collect()
    };
    root.fill(&WHITE)?;
    let (panels, notes) = root.split_vertically(1030);
    // Below the panels: the numbered decisions (at most LISTED, 18 px a row in two columns).
    let panels = panels.split_evenly((4, 1));
    let font = |px: u32| ("sans-serif", px).into_font();
    // Epoch boundaries: dashed grey verticals over a panel's y range.
    macro_rules! epoch_lines {
        ($c:expr, $y0:expr, $y1:expr) => {
            for &(t, _) in &epochs {
                $c.draw_series(DashedLineSeries::new(
                    [(t, $y0), (t, $y1)],
                    6,
                    4,
                    GREY.stroke_width(1),
                ))?;
            }
        };
    }

    // 1. Batches per second (over the window; each tick faint), the decisions numbered on
    // the line with their knob.
    let rate = smoothed(recs, |r| r.rate);
    let max_rate = rate.iter().map(|&(_, v)| v).fold(1.0, f64::max) * 1.3;
    let mut c = ChartBuilder::on(&panels[0])
        .caption(
            format!("delivered per second, over {WINDOW_S:.0} s (faint: each 0.1-s tick); dots: tuner decisions; dashes: epochs"),
            font(17),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(t0..t1, 0.0..max_rate)?;
    c.configure_mesh()
        .x_desc("seconds")
        .y_desc("results/s")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    epoch_lines!(c, 0.0, max_rate);
    for &(t, e) in &epochs {
        c.draw_series(std::iter::once(Text::new(
            format!("epoch {}", e + 1),
            (t, max_rate * 0.97),
            font(12).color(&GREY),
        )))?;
    }
    c.draw_series(LineSeries::new(
        recs.iter().map(|r| (r.t, r.rate.min(max_rate))),
        PALETTE[0].mix(0.18).stroke_width(1),
    ))?;
    c.draw_series(LineSeries::new(
        rate.iter().copied(),
        PALETTE[0].stroke_width(3),
    ))?;
    let ticks: Vec<(usize, &TraceRecord)> = recs
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.decisions.is_empty())
        .collect();
    for (n, &(i, r)) in ticks.iter().enumerate().take(LISTED) {
        let y = rate[i].1;
        c.draw_series(std::iter::once(Circle::new(
            (r.t, y),
            4,
            PALETTE[3].filled(),
        )))?;
        // Labels alternate above and below the line so neighbours do not collide.
        let dy = if n % 2 == 0 { 0.07 } else { -0.06 };
        c.draw_series(std::iter::once(Text::new(
            format!("{} {}", n + 1, r.decisions.first().map_or("", knob)),
            (r.t, (y + dy * max_rate).clamp(0.0, max_rate)),
            font(12),
        )))?;
    }

    // 2. The consumer's wait.
    let mut c = ChartBuilder::on(&panels[1])
        .caption(
            format!("the training loop waiting for data (% of the time, over {WINDOW_S:.0} s)"),
            font(17),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(t0..t1, 0.0..100.0)?;
    c.configure_mesh()
        .x_desc("seconds")
        .y_desc("% waiting")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    epoch_lines!(c, 0.0, 100.0);
    c.draw_series(LineSeries::new(
        smoothed(recs, |r| 100.0 * r.wait.clamp(0.0, 1.0)),
        PALETTE[3].stroke_width(2),
    ))?;

    // 3. Workers per stage: integer counts; a log axis only when some stage runs many (an
    // async fetch stage may run hundreds).
    let max_w = recs
        .iter()
        .flat_map(|r| r.workers.iter().copied())
        .max()
        .unwrap_or(1)
        .max(1);
    let mut area = ChartBuilder::on(&panels[2]);
    area.caption("workers per stage", font(17))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60);
    let stages: Vec<(usize, &String)> = first
        .stages
        .iter()
        .enumerate()
        .filter(|(_, n)| n.as_str() != "sink")
        .collect();
    // Overlapping lines stay visible: each stage is drawn a little thicker than the next.
    let series = |i: usize| {
        let w = stages.len().saturating_sub(i) as u32 + 1;
        PALETTE[i % PALETTE.len()].stroke_width(w)
    };
    // Each stage's workers as a step line on chart `c` (y values through `y`), with a legend.
    macro_rules! worker_lines {
        ($c:expr, $y:expr) => {
            for (k, &(i, name)) in stages.iter().enumerate() {
                let style = series(k);
                $c.draw_series(LineSeries::new(
                    steps(recs, |r| r.workers.get(i).map(|&w| w as f64))
                        .into_iter()
                        .map(|(t, w)| (t, $y(w))),
                    style,
                ))?
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            }
            $c.configure_series_labels()
                .border_style(BLACK)
                .background_style(WHITE.mix(0.85))
                .label_font(font(13))
                .draw()?;
        };
    }
    if max_w > 32 {
        let mut c = area.build_cartesian_2d(t0..t1, (0.9..max_w as f64 * 1.5).log_scale())?;
        c.configure_mesh()
            .x_desc("seconds")
            .y_desc("workers (log)")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .draw()?;
        epoch_lines!(c, 0.9, max_w as f64 * 1.5);
        worker_lines!(c, |w: f64| w);
    } else {
        let top = max_w as i64 + 1;
        let mut c = area.build_cartesian_2d(t0..t1, 0i64..top)?;
        c.configure_mesh()
            .x_desc("seconds")
            .y_desc("workers")
            .y_labels(top as usize + 1)
            .y_label_formatter(&|v| format!("{v}"))
            .draw()?;
        epoch_lines!(c, 0, top);
        worker_lines!(c, |w: f64| w as i64);
    }

    // 4. Memory, in MiB: what the buffers hold, the process's RSS, and the budget when it is
    // within sight (a budget of half the machine would flatten the rest).
    let buffered = |r: &TraceRecord| r.buffered_bytes as f64 / MIB;
    let rss = |r: &TraceRecord| r.rss_bytes.map(|b| b as f64 / MIB);
    let seen = recs
        .iter()
        .map(|r| buffered(r).max(rss(r).unwrap_or(0.0)))
        .fold(1.0, f64::max);
    let budget = last.memory_budget as f64 / MIB;
    let show_budget = budget <= seen * 4.0;
    let top = if show_budget { budget.max(seen) } else { seen } * 1.1;
    let mut c = ChartBuilder::on(&panels[3])
        .caption(
            if show_budget {
                format!("memory, MiB (budget {budget:.0} MiB)")
            } else {
                format!("memory, MiB (the budget, {budget:.0} MiB, is off the scale)")
            },
            font(17),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(t0..t1, 0.0..top)?;
    c.configure_mesh()
        .x_desc("seconds")
        .y_desc("MiB")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    epoch_lines!(c, 0.0, top);
    c.draw_series(LineSeries::new(
        recs.iter().map(|r| (r.t, buffered(r))),
        PALETTE[2].stroke_width(2),
    ))?
    .label("buffered in the pipeline")
    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], PALETTE[2].stroke_width(2)));
    if recs.iter().any(|r| r.rss_bytes.is_some()) {
        c.draw_series(LineSeries::new(
            recs.iter().filter_map(|r| rss(r).map(|m| (r.t, m))),
            PALETTE[4].stroke_width(2),
        ))?
        .label("process RSS")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], PALETTE[4].stroke_width(2)));
    }
    if show_budget {
        c.draw_series(DashedLineSeries::new(
            [(t0, budget), (t1, budget)],
            8,
            4,
            BLACK.stroke_width(1),
        ))?
        .label("memory budget")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    c.configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .label_font(font(13))
        .draw()?;

    // The decisions, numbered as on the first panel, in two columns.
    let mut lines: Vec<String> = Vec::new();
    for (n, (_, r)) in ticks.iter().enumerate().take(LISTED) {
        let what: Vec<String> = r.decisions.iter().map(|d| short(d, &r.stages)).collect();
        let why = r.decisions.first().map_or("", |d| d.reason.as_str());
        let mut line = format!("{}. @{:.1}s {}: {}", n + 1, r.t, what.join(", "), why);
        if line.chars().count() > 78 {
            line = line.chars().take(77).collect::<String>() + "…";
        }
        lines.push(line);
    }
    if ticks.len() > LISTED {
        lines.push(format!(
            "… and {} more ticks with decisions",
            ticks.len() - LISTED
        ));
    }
    let half = lines.len().div_ceil(2);
    for (k, line) in lines.iter().enumerate() {
        let (col, row) = (k / half.max(1), k % half.max(1));
        notes.draw(&Text::new(
            line.clone(),
            (20 + col as i32 * 490, 8 + row as i32 * 18),
            font(12),
        ))?;
    }
    root.present()?;
    Ok(())
}

/// A step line: each value held until the next record (workers change at ticks, not between).
fn steps(recs: &[TraceRecord], f: impl Fn(&TraceRecord) -> Option<f64>) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    let mut prev: Option<f64> = None;
    for r in recs {
        if let Some(v) = f(r) {
            if let Some(p) = prev {
                out.push((r.t, p));
            }
            out.push((r.t, v));
            prev = Some(v);
        }
    }
    out
}
