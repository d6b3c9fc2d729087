//! `flowgate top` on a node with three ranks of a job, one slowed on purpose: on the screen of
//! a pseudo-terminal (80 columns), live, it shows the three, one line each, and names the slow
//! one as the straggler with its bottleneck.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{dataset, scratch};

fn flowgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flowgate"))
}

/// A rank of job `job`: `flowgate run` over the sample images for `seconds`, decoding crops
/// of `size`² on one worker, with the board in `board`.
fn rank(dir: &Path, board: &Path, rank: usize, size: u32, seconds: u32) -> Child {
    let list = dir.join("images.txt");
    if !list.exists() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dataset().join("images"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        let text: Vec<String> = v.iter().map(|p| p.display().to_string()).collect();
        std::fs::write(&list, text.join("\n")).unwrap();
    }
    let file = dir.join(format!("rank{rank}.toml"));
    std::fs::write(
        &file,
        format!(
            "[source]\nkind = \"list\"\npath = \"{}\"\n[decode]\nkind = \"image\"\nresize = {size}\n\
             crop = {size}\n[loader]\nworkers = 1\nbatch_size = 4\n[run]\nepochs = 100000\n\
             seconds = {seconds}\n",
            list.display()
        ),
    )
    .unwrap();
    flowgate()
        .args(["run", "--quiet"])
        .arg(&file)
        .env("FLOWGATE_BOARD_DIR", board)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", "3")
        .env("MASTER_PORT", "29777")
        .env_remove("TORCHELASTIC_RUN_ID")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// `flowgate top` on a terminal of `cols`×`rows` for `secs` seconds: the screens it drew.
fn top_on_a_terminal(board: &Path, cols: u16, rows: u16, secs: u64) -> Vec<Vec<String>> {
    let (mut reader, slave) = common::pty(cols, rows);
    let mut child = flowgate()
        .arg("top")
        .env("FLOWGATE_BOARD_DIR", board)
        .env("COLUMNS", cols.to_string())
        .stdout(slave)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(secs));
        // SAFETY: a signal to the child we started.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
    });
    let mut parser = vt100::Parser::new(rows, cols, 0);
    let mut screens = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = reader.read(&mut buf) {
        parser.process(&buf[..n]);
        screens.push(parser.screen().rows(0, cols).collect());
    }
    stopper.join().unwrap();
    let _ = child.wait();
    screens
}

#[test]
fn top_shows_a_jobs_three_ranks_and_names_the_slowed_one() {
    let dir = scratch("top");
    let board = dir.join("board");
    // Rank 1 decodes crops 16 times larger (256² against 64²): the straggler, held back by
    // its decode stage.
    let mut ranks: Vec<Child> = [64, 256, 64]
        .iter()
        .enumerate()
        .map(|(r, &size)| rank(&dir, &board, r, size, 40))
        .collect();
    // The records come within a second or two of the pipelines' start.
    let start = Instant::now();
    while flowgate::board::read(&board).len() < 3 && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(3)); // a few windows of rates
    let screens = top_on_a_terminal(&board, 80, 24, 4);
    for r in &mut ranks {
        let _ = r.kill();
        let _ = r.wait();
    }
    assert!(screens.len() > 2, "{} screens", screens.len());
    let last = screens.last().unwrap();
    let text = last.join("\n");
    let lines: Vec<&String> = last.iter().filter(|l| l.starts_with("29777")).collect();
    assert_eq!(lines.len(), 3, "one line per rank:\n{text}");
    for (k, l) in lines.iter().enumerate() {
        let cols: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(cols[1], k.to_string(), "rank column:\n{text}");
    }
    assert!(
        text.contains("straggler: rank 1") && text.contains("held back by the decode stage"),
        "{text}"
    );
    assert!(last.iter().all(|l| l.trim_end().chars().count() <= 80));
    // The ranks gone, their records go too.
    let start = Instant::now();
    while !flowgate::board::read(&board).is_empty() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(flowgate::board::read(&board).is_empty());
}
