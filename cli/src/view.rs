//! The live view of `flowgate run`: on a terminal, a block of lines redrawn in place (each cut
//! to the terminal's width, so nothing wraps and a redraw leaves no stale line), with log lines
//! (tuner decisions, library warnings, panic messages) printed above it; elsewhere (a batch
//! job's log) one concise line per interval.
//!
//! Everything flowgate writes to stderr while a run is on goes through [`log`]: the tracing
//! subscriber's writer ([`LogWriter`]) and the panic hook ([`route_panics`]) too, so no message
//! lands inside a frame.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flowgate::PipelineStats;

use crate::rates::Rates;
use crate::text::{bar, bytes, clock, cut};

/// How the view shows itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Mode {
    /// Nothing but the log lines (`--quiet`).
    Off,
    /// A frame redrawn in place on a terminal.
    Terminal,
    /// One line per interval (stderr is a file or a pipe).
    Lines(Duration),
}

/// What the view knows of the run.
pub(crate) struct View {
    mode: Mode,
    /// Lines of the frame on screen (to move up over).
    drawn: usize,
    /// The statistics of the previous update, for rates, and of the first (for the whole
    /// run's, at the end).
    prev: Option<(Instant, PipelineStats)>,
    first: Option<(Instant, PipelineStats)>,
    /// Recent statistics (and the process's CPU seconds then), oldest first, spanning the
    /// rate window: the terminal's rates and the decisions' are over it.
    recent: std::collections::VecDeque<(Instant, PipelineStats, Option<f64>)>,
    /// When the last progress line was written (line mode).
    last_line: Option<Instant>,
    /// This process's core-nanoseconds on the node's CPU budget at the last frame.
    node_prev: Option<(Instant, u64)>,
    started: Instant,
    /// The epoch being run (1-based) and how many.
    pub(crate) epoch: (u64, u64),
    /// The run's time limit (`[run] seconds`), if it has one.
    seconds: Option<f64>,
    /// Items per epoch (this rank's), and delivered so far: this epoch, and in all.
    pub(crate) epoch_items: usize,
    pub(crate) done: usize,
    pub(crate) done_total: usize,
    /// Items that failed this epoch (they count as processed, not delivered).
    pub(crate) failed: usize,
    /// Lines to print above the frame at the next redraw.
    pending: Vec<String>,
    /// CPU seconds of the process at the previous update.
    cpu: Option<(Instant, f64)>,
    /// The tuner: its policy, the memory budget, the last decision and when.
    pub(crate) policy: Option<String>,
    memory_budget: Option<u64>,
    last_decision: Option<(Instant, String)>,
    /// Failures by reason: how many, and the latest item.
    failures: BTreeMap<String, (u64, String)>,
    latest_failure: Option<String>,
}

/// What the terminal's rates and the tuner decisions' are averaged over: long enough to span
/// a stage's bursts (a batch's items finish together, a decode takes tens of ms), short
/// enough to follow a change.
const RATE_WINDOW: Duration = Duration::from_secs(2);

static VIEW: Mutex<Option<View>> = Mutex::new(None);

/// The view, locked (`None` before [`start`] and after [`finish`]).
fn view() -> MutexGuard<'static, Option<View>> {
    VIEW.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts the view.
pub(crate) fn start(
    mode: Mode,
    epochs: u64,
    epoch_items: usize,
    policy: Option<String>,
    seconds: Option<f64>,
) {
    *view() = Some(View {
        seconds,
        mode,
        drawn: 0,
        prev: None,
        first: None,
        recent: Default::default(),
        node_prev: None,
        last_line: None,
        started: Instant::now(),
        epoch: (0, epochs),
        epoch_items,
        done: 0,
        done_total: 0,
        failed: 0,
        pending: Vec::new(),
        cpu: None,
        policy,
        memory_budget: None,
        last_decision: None,
        failures: BTreeMap::new(),
        latest_failure: None,
    });
}

/// Runs `f` on the view, if it is on.
pub(crate) fn with(f: impl FnOnce(&mut View)) {
    if let Some(v) = view().as_mut() {
        f(v);
    }
}

/// A line for stderr: above the frame on a terminal (at the next redraw, which happens at once
/// when `now`), straight to stderr otherwise.
pub(crate) fn log(line: String) {
    let mut g = view();
    match g.as_mut() {
        Some(v) if v.mode == Mode::Terminal => {
            v.pending.push(line);
        }
        _ => {
            drop(g);
            eprintln!("{line}");
        }
    }
}

/// The failures of a run grouped by reason: (reason, how many, the latest item), most
/// frequent first.
pub(crate) type FailureGroups = Vec<(String, u64, String)>;

/// Prints what is pending and leaves the last frame on screen; the view is off afterwards.
/// Returns the run's failures by reason.
pub(crate) fn finish(last: &PipelineStats) -> FailureGroups {
    let Some(mut v) = view().take() else {
        return Vec::new();
    };
    {
        let mut err = std::io::stderr().lock();
        if v.mode == Mode::Terminal {
            v.clear(&mut err);
        }
        for line in v.pending.drain(..) {
            let _ = writeln!(err, "{line}");
        }
        // The last frame (or line), over the whole run, from the run's final statistics (the
        // summary's): a record of where it ended.
        // A run shorter than the statistics' interval has no first statistics: from zero.
        let (t0, first) = v
            .first
            .clone()
            .unwrap_or_else(|| (v.started, PipelineStats::default()));
        {
            let dt = t0.elapsed();
            match v.mode {
                Mode::Terminal => {
                    let frame = v.frame(last, &first, dt, size());
                    let _ = err.write_all(frame.as_bytes());
                }
                Mode::Lines(_) => {
                    let line = v.line(last, &first, dt);
                    let _ = writeln!(err, "{line}");
                }
                Mode::Off => {}
            }
        }
    }
    let mut groups: FailureGroups = std::mem::take(&mut v.failures)
        .into_iter()
        .map(|(reason, (n, item))| (reason, n, item))
        .collect();
    groups.sort_by_key(|g| std::cmp::Reverse(g.1));
    groups
}

/// Tracing's writer: each event becomes a [`log`] line.
#[derive(Default)]
pub(crate) struct LogWriter(Vec<u8>);

impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.0);
        for line in text.lines().filter(|l| !l.is_empty()) {
            log(line.to_owned());
        }
    }
}

/// Panic messages (a library's, a worker's) go through [`log`] instead of into a frame. A
/// panic while the view is locked (in the view itself, on this thread) prints straight away
/// instead of waiting for a lock it holds.
pub(crate) fn route_panics() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let line = format!(
            "panic in thread '{}': {info}",
            thread.name().unwrap_or("<unnamed>")
        );
        match VIEW.try_lock() {
            Ok(mut g) => match g.as_mut() {
                Some(v) if v.mode == Mode::Terminal => v.pending.push(line),
                _ => {
                    drop(g);
                    eprintln!("{line}");
                }
            },
            Err(_) => eprintln!("{line}"),
        }
    }));
}

impl View {
    /// A tuner decision: logged above the frame, and remembered as the tuner's state.
    pub(crate) fn decision(&mut self, r: &flowgate::TraceRecord, line: String, what: String) {
        self.memory_budget = Some(r.memory_budget);
        self.last_decision = Some((Instant::now(), what));
        if self.mode == Mode::Terminal {
            self.pending.push(line);
        } else {
            eprintln!("{line}");
        }
    }

    /// An item failure, grouped by its reason.
    pub(crate) fn failure(&mut self, e: &flowgate::ItemError) {
        let reason = reason(&e.cause().to_string(), e.item());
        let entry = self.failures.entry(reason).or_insert((0, String::new()));
        entry.0 += 1;
        entry.1 = e.item().to_owned();
        self.failed += 1;
        self.latest_failure = Some(format!("{}: {}", e.item(), e.cause()));
    }

    /// New statistics: a redraw on a terminal, a line per interval otherwise.
    pub(crate) fn update(&mut self, stats: &PipelineStats) {
        let now = Instant::now();
        if self.first.is_none() {
            self.first = Some((now, stats.clone()));
        }
        self.recent.push_back((now, stats.clone(), cpu_seconds()));
        // Keep the newest statistics at least a window old (the base of the rates).
        while self
            .recent
            .get(1)
            .is_some_and(|(t, _, _)| now.duration_since(*t) >= RATE_WINDOW)
        {
            self.recent.pop_front();
        }
        let Some((then, prev)) = self.prev.replace((now, stats.clone())) else {
            return;
        };
        match self.mode {
            Mode::Off => {}
            Mode::Terminal => {
                let (then, prev, cpu) = self.recent.front().cloned().unwrap_or((then, prev, None));
                self.cpu = cpu.map(|c| (then, c));
                let frame = self.frame(stats, &prev, now.duration_since(then), size());
                let mut err = std::io::stderr().lock();
                self.clear(&mut err);
                for line in self.pending.drain(..) {
                    let _ = writeln!(err, "{line}");
                }
                let _ = err.write_all(frame.as_bytes());
                let _ = err.flush();
                self.drawn = frame.lines().count();
            }
            Mode::Lines(every) => {
                if self
                    .last_line
                    .is_some_and(|t| now.duration_since(t) < every)
                {
                    // Rates over the whole interval: keep the interval's first statistics.
                    self.prev = Some((then, prev));
                    return;
                }
                self.last_line = Some(now);
                let line = self.line(stats, &prev, now.duration_since(then));
                eprintln!("{line}");
            }
        }
    }

    /// Moves up over the frame on screen and clears to the end of the screen.
    fn clear(&mut self, err: &mut impl std::io::Write) {
        if self.drawn > 0 {
            let _ = write!(err, "\r\x1b[{}A\x1b[J", self.drawn);
            self.drawn = 0;
        }
    }

    /// Batches per second over the rate window (the figure the view shows), and the window
    /// in seconds; `None` before two statistics.
    pub(crate) fn batches_per_s(&self) -> Option<(f64, f64)> {
        let ((t0, a, _), (t1, b, _)) = (self.recent.front()?, self.recent.back()?);
        let dt = t1.duration_since(*t0).as_secs_f64();
        (dt > 0.0).then(|| (b.delivered.saturating_sub(a.delivered) as f64 / dt, dt))
    }

    /// `epoch 3/12`; in a run with a time limit, which ends before its epochs do, `epoch 3`.
    fn epoch_label(&self) -> String {
        match self.seconds {
            Some(_) => format!("epoch {}", self.epoch.0),
            None => format!("epoch {}/{}", self.epoch.0, self.epoch.1),
        }
    }

    /// Seconds to the end of the run at the run's rate so far, if known.
    fn eta(&self) -> Option<f64> {
        let elapsed = self.started.elapsed().as_secs_f64();
        if self.done_total == 0 || elapsed <= 0.0 {
            return None;
        }
        let rate = self.done_total as f64 / elapsed;
        let left_epochs = self.epoch.1.saturating_sub(self.epoch.0) as usize;
        let left = self.epoch_items.saturating_sub(self.done) + left_epochs * self.epoch_items;
        let by_epochs = left as f64 / rate;
        // A run with a time limit ends at it, if the epochs do not end first.
        Some(
            self.seconds
                .map_or(by_epochs, |t| by_epochs.min((t - elapsed).max(0.0))),
        )
    }

    /// The process's CPU use in cores since the previous call.
    fn cpu_cores(&mut self) -> Option<f64> {
        let now = (Instant::now(), cpu_seconds()?);
        let prev = self.cpu.replace(now)?;
        let dt = now.0.duration_since(prev.0).as_secs_f64();
        (dt > 0.0).then(|| (now.1 - prev.1) / dt)
    }

    /// On a node CPU budget: this rank's cores since the last frame, of the budget, and how
    /// many the node's ranks hold now (`  node 0.8 of 2 cores, 2 busy`); empty otherwise.
    fn node_share(&mut self) -> String {
        let Some(node) = flowgate::actors::node::current() else {
            return String::new();
        };
        let now = (
            Instant::now(),
            flowgate::actors::node::process_cores().held_ns,
        );
        let share = self.node_prev.replace(now).and_then(|prev| {
            let dt = now.0.duration_since(prev.0).as_secs_f64();
            (dt > 0.0).then(|| now.1.saturating_sub(prev.1) as f64 / 1e9 / dt)
        });
        format!(
            "  node {} of {} cores, {} busy",
            share.map_or_else(|| "-".to_owned(), |s| format!("{s:.1}")),
            node.cores(),
            node.in_use()
        )
    }

    /// The frame on a terminal `width` columns wide and `height` rows high.
    fn frame(
        &mut self,
        now: &PipelineStats,
        prev: &PipelineStats,
        dt: Duration,
        (width, height): (usize, usize),
    ) -> String {
        let r = Rates::new(now, prev, dt);
        let mut lines = Vec::new();
        let pct = self.processed_pct();
        lines.push(format!(
            // The ETA before the elapsed time: a narrow terminal cuts the end of the line.
            "{} {} {}/{} items{} {:.0}%  ETA {}  elapsed {}",
            self.epoch_label(),
            bar(pct, 20),
            self.done,
            self.epoch_items,
            self.failed_note(),
            pct,
            self.eta().map_or_else(|| "-".to_owned(), clock),
            clock(self.started.elapsed().as_secs_f64()),
        ));
        lines.push(format!(
            "{:.1} batches/s, {:.0} items/s (last {:.0} s)  consumer waits {:.0}%  bottleneck: {}",
            r.batches,
            r.items,
            r.dt,
            100.0 * r.wait.min(1.0),
            r.bottleneck(now)
        ));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpu = self
            .cpu_cores()
            .map_or_else(|| "-".to_owned(), |c| format!("{c:.1}"));
        let buffered = now.bytes_held();
        let node = self.node_share();
        lines.push(format!(
            "cpu {cpu} of {cores} cores  rss {}  buffered {}{}{node}",
            rss_bytes().map_or_else(|| "-".to_owned(), bytes),
            bytes(buffered),
            self.memory_budget
                .map_or_else(String::new, |b| format!(" of {} budget", bytes(b)))
        ));
        lines.push(self.failures_line(now.failures));
        lines.push(match (&self.policy, &self.last_decision) {
            (None, _) => "tuner off".to_owned(),
            (Some(p), None) => format!("tuner ({p}): watching, no change yet"),
            (Some(p), Some((t, what))) => format!(
                "tuner ({p}): last change {} ago: {what}",
                clock(t.elapsed().as_secs_f64())
            ),
        });
        lines.push(format!(
            "  {:<12} {:>7} {:>11} {:>9} {:>5}",
            "stage", "workers", "queue", "out/s", "busy"
        ));
        for s in &now.stages {
            let queue = if s.budget_items == 0 || s.budget_items == usize::MAX {
                format!("{}", s.queue_items)
            } else {
                format!("{}/{}", s.queue_items, s.budget_items)
            };
            let busy = if Rates::works(s) {
                format!("{:.0}%", 100.0 * r.busy(s).min(1.0))
            } else {
                "-".to_owned()
            };
            lines.push(format!(
                "  {:<12} {:>7} {:>11} {:>9.0} {:>5}",
                s.name,
                s.workers,
                queue,
                r.out(s),
                busy
            ));
        }
        // The frame fits the terminal's height too (a taller one would scroll at every
        // redraw): the lines come most important first, the stage table last; one row is
        // left for the cursor.
        lines.truncate(height.saturating_sub(1).max(1));
        let mut out = String::new();
        for l in lines {
            let _ = writeln!(out, "{}", cut(&l, width.saturating_sub(1).max(10)));
        }
        out
    }

    /// The failures: how many, grouped by reason, and the latest.
    fn failures_line(&self, total: u64) -> String {
        if total == 0 {
            return "failures 0".to_owned();
        }
        let mut groups: Vec<(&String, &(u64, String))> = self.failures.iter().collect();
        groups.sort_by_key(|g| std::cmp::Reverse(g.1 .0));
        let groups: Vec<String> = groups
            .iter()
            .take(3)
            .map(|(reason, (n, _))| format!("{n}x {reason}"))
            .collect();
        format!(
            "failures {total}: {}; latest: {}",
            groups.join(", "),
            self.latest_failure.as_deref().unwrap_or("-")
        )
    }

    /// The share of the epoch processed: its items delivered or failed.
    fn processed_pct(&self) -> f64 {
        let processed = (self.done + self.failed) as f64;
        (100.0 * processed / self.epoch_items.max(1) as f64).min(100.0)
    }

    /// ` + N failed` when items of this epoch failed.
    fn failed_note(&self) -> String {
        match self.failed {
            0 => String::new(),
            n => format!(" + {n} failed"),
        }
    }

    /// One progress line (not a terminal).
    fn line(&mut self, now: &PipelineStats, prev: &PipelineStats, dt: Duration) -> String {
        let r = Rates::new(now, prev, dt);
        let pct = self.processed_pct();
        let cpu = self
            .cpu_cores()
            .map_or_else(|| "-".to_owned(), |c| format!("{c:.1}"));
        let node = self.node_share();
        format!(
            "[{}] {} {}/{} items{} ({pct:.0}%) ETA {}  {:.1} batches/s  wait {:.0}%  \
             bottleneck {}  cpu {cpu} cores{node}  rss {}  failures {}",
            clock(self.started.elapsed().as_secs_f64()),
            self.epoch_label(),
            self.done,
            self.epoch_items,
            self.failed_note(),
            self.eta().map_or_else(|| "-".to_owned(), clock),
            r.batches,
            100.0 * r.wait.min(1.0),
            r.bottleneck(now),
            rss_bytes().map_or_else(|| "-".to_owned(), bytes),
            now.failures
        )
    }
}

/// A failure's reason without its item (so that the same reason groups across files), whole:
/// a terminal's frame cuts its lines to the width, a file or a pipe gets every word.
fn reason(cause: &str, item: &str) -> String {
    if item.is_empty() {
        cause.to_owned()
    } else {
        cause.replace(item, "…")
    }
}

/// The terminal's width and height (stderr's), else `$COLUMNS` and `$LINES`, else 80×24.
fn size() -> (usize, usize) {
    // SAFETY: TIOCGWINSZ fills a winsize; a failure leaves it zeroed.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::ioctl(2, libc::TIOCGWINSZ, &mut ws) } == 0;
    let env = |k: &str, default: usize| {
        std::env::var(k)
            .ok()
            .and_then(|c| c.parse().ok())
            .filter(|&c| c > 0)
            .unwrap_or(default)
    };
    let w = if ok && ws.ws_col > 0 {
        ws.ws_col as usize
    } else {
        env("COLUMNS", 80)
    };
    let h = if ok && ws.ws_row > 0 {
        ws.ws_row as usize
    } else {
        env("LINES", 24)
    };
    (w, h)
}

/// The process's resident memory (Linux; None elsewhere).
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * page.max(1) as u64)
}

/// CPU seconds (user + system) the process has used (Linux; None elsewhere).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at its closing paren.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Some(ticks / hz.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_drop_the_item() {
        assert_eq!(
            reason("reading /d/x.jpg: No such file", "/d/x.jpg"),
            "reading …: No such file"
        );
        // Whole, however long (a terminal's frame cuts its lines to the width).
        let long = format!(
            "riff: chunk length exceeds parent{}",
            " and more".repeat(20)
        );
        assert_eq!(reason(&long, "/d/x.wav"), long);
    }

    #[test]
    fn cpu_and_memory_are_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(rss_bytes().unwrap() > 0);
            assert!(cpu_seconds().unwrap() >= 0.0);
        }
    }
}
