//! `flowgate top`: every flowgate loader of this user on the node, one line per pipeline,
//! from the node's board (`flowgate::board`): rank, items/s, the training loop's wait,
//! decode workers against the cores it may use, memory against its budget, the bottleneck
//! and failures; the straggler of each torchrun job named with its bottleneck (never an idle
//! loader, nor loaders of unrelated processes: without a job each process is its own group).
//! Lines fit the terminal, or are whole into a pipe. No configuration:
//! every pipeline (`flowgate run`, Rust programs, Python loaders, torchrun ranks) publishes
//! its record once a second.

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Duration;

use flowgate::board::{self, Record};

use crate::Error;

/// Shows the board: once (`once`, or when stdout is not a terminal), or redrawn every
/// `interval` until interrupted.
pub(crate) fn top(once: bool, interval: Duration) -> Result<(), Error> {
    let dir = board::dir();
    let live = !once && std::io::IsTerminal::is_terminal(&std::io::stdout());
    loop {
        let records = board::read(&dir);
        // The terminal's width; into a pipe or file, whole lines (unless COLUMNS says).
        let width = terminal_width().unwrap_or(usize::MAX);
        let frame = render(&records, &dir.display().to_string(), width);
        let mut out = std::io::stdout().lock();
        if live {
            // Home, the frame, then clear what an older, longer frame left below it.
            let _ = write!(out, "\x1b[H{frame}\x1b[J");
        } else {
            let _ = write!(out, "{frame}");
        }
        let _ = out.flush();
        if !live {
            return Ok(());
        }
        std::thread::sleep(interval);
    }
}

/// The terminal's columns (`COLUMNS`, else the terminal's; `None` when stdout is none).
fn terminal_width() -> Option<usize> {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .or_else(|| {
            // SAFETY: TIOCGWINSZ fills a winsize; stdout may not be a terminal (then -1).
            let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
            let rc = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) };
            (rc == 0 && ws.ws_col > 0).then_some(usize::from(ws.ws_col))
        })
}

fn mib(b: u64) -> f64 {
    flowgate::limits::bytes_to_mib(b)
}

/// The board as text: a heading, a table (lines cut to `width` columns), and one line per
/// straggler naming its rank and bottleneck.
pub(crate) fn render(records: &[Record], dir: &str, width: usize) -> String {
    let mut s = String::new();
    let title = format!(
        "flowgate top: {} loader(s) on this node (board {dir})",
        records.len()
    );
    let _ = writeln!(s, "{}", cut(&title, width));
    let heading = format!(
        "{:<6} {:>4} {:>7} {:>8} {:>5} {:>7} {:>11} {:<10} {:>6} {:>5}",
        "job",
        "rank",
        "pid",
        "items/s",
        "wait",
        "workers",
        "memory MiB",
        "bottleneck",
        "failed",
        "epoch"
    );
    let _ = writeln!(s, "{}", cut(&heading, width));
    let stragglers = board::stragglers(records);
    for (i, r) in records.iter().enumerate() {
        let cores = format!(
            "{}/{}{}",
            r.decode_workers,
            r.cores,
            if r.node_budget { "n" } else { "" }
        );
        let memory = match r.memory_budget {
            Some(b) => format!("{:.0}/{:.0}", mib(r.bytes), mib(b))
                .chars()
                .take(11)
                .collect(),
            None => format!("{:.0}/-", mib(r.bytes)),
        };
        // The torchrun job; without one (`-`) each process is its own group.
        let job: String = r.job.as_deref().unwrap_or("-").chars().take(6).collect();
        let line = format!(
            "{:<6} {:>4} {:>7} {:>8.1} {:>4.0}% {:>7} {:>11} {:<10} {:>6} {:>5}{}",
            job,
            r.rank.map_or("-".to_owned(), |k| k.to_string()),
            r.pid,
            r.items_per_s,
            r.wait * 100.0,
            cores,
            memory,
            if board::idle(r) {
                "idle"
            } else {
                &r.bottleneck
            },
            r.failures,
            r.epoch,
            if stragglers.contains(&i) { " <" } else { "" }
        );
        let _ = writeln!(s, "{}", cut(&line, width));
    }
    for &i in &stragglers {
        let r = &records[i];
        let why = flowgate::board::held_back_by(&r.bottleneck);
        let line = format!(
            "straggler: rank {} (pid {}) at {:.0} items/s, held back by {why}",
            r.rank.map_or("-".to_owned(), |k| k.to_string()),
            r.pid,
            r.items_per_s
        );
        let _ = writeln!(s, "{}", cut(&line, width));
    }
    if records.is_empty() {
        let _ = writeln!(s, "(no flowgate loader is running for this user)");
    }
    s
}

/// `line` cut to `width` characters.
fn cut(line: &str, width: usize) -> String {
    line.chars().take(width.max(1)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rank: u64, rate: f64, bottleneck: &str) -> Record {
        Record {
            pid: 100 + rank as u32,
            program: "flowgate".into(),
            rank: Some(rank),
            local_rank: Some(rank),
            world_size: Some(3),
            job: Some("29500".into()),
            items_per_s: rate,
            wait: 0.4,
            decode_workers: 1,
            cores: 2,
            node_budget: false,
            bytes: 3 << 20,
            memory_budget: Some(96 << 20),
            bottleneck: bottleneck.into(),
            failures: 0,
            epoch: 1,
            updated: 0.0,
        }
    }

    #[test]
    fn the_board_names_the_straggler_and_fits_the_width() {
        let r = vec![
            rec(0, 900.0, "step"),
            rec(1, 120.0, "decode"),
            rec(2, 880.0, "step"),
        ];
        let text = render(&r, "/dev/shm/x", 80);
        assert!(text.contains("straggler: rank 1 (pid 101)"), "{text}");
        assert!(text.contains("held back by the decode stage"), "{text}");
        assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");
        assert!(render(&[], "/d", 80).contains("no flowgate loader"));
    }

    #[test]
    fn an_idle_loader_or_another_process_is_never_a_straggler() {
        // A training loader and an idle validation loader of one process (no torchrun job,
        // no ranks), and a loader of another process: no straggler, each its own process.
        let mut train = rec(0, 900.0, "step");
        let mut val = rec(0, 0.0, "step");
        val.wait = 0.0;
        let mut other = rec(0, 50.0, "decode");
        for r in [&mut train, &mut val, &mut other] {
            r.job = None;
            r.rank = None;
        }
        val.pid = train.pid;
        other.pid = 4242;
        let text = render(&[train.clone(), val.clone(), other], "/d", 200);
        assert!(!text.contains("straggler"), "{text}");
        assert!(text.contains("idle"), "the idle loader says so: {text}");
        // Ranks of a job: an idle rank is not the straggler; a stalled one (its loop waits) is.
        let mut idle = rec(1, 0.0, "step");
        idle.wait = 0.0;
        let r = vec![rec(0, 900.0, "step"), idle, rec(2, 880.0, "step")];
        assert!(!render(&r, "/d", 200).contains("straggler"));
        let mut stalled = rec(1, 0.0, "decode");
        stalled.wait = 0.9;
        let r = vec![rec(0, 900.0, "step"), stalled, rec(2, 880.0, "step")];
        assert!(render(&r, "/d", 200).contains("straggler: rank 1"));
    }

    #[test]
    fn lines_are_whole_into_a_pipe() {
        let mut r = rec(0, 900.0, "a-stage-name-the-user-wrote");
        r.job = Some("a-long-torchrun-job-id".into());
        let text = render(&[r], "/dev/shm/a/long/board/directory/name", usize::MAX);
        assert!(
            text.contains("/dev/shm/a/long/board/directory/name"),
            "{text}"
        );
        assert!(text.contains("a-stage-name-the-user-wrote"), "{text}");
    }
}
