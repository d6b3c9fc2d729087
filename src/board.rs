//! The node's board: every running pipeline of this user on the host publishes one small
//! record about itself once a second, which `flowgate top` reads to show every loader of the
//! node on one screen (which rank is slow, and why) with no configuration.
//!
//! # Protocol
//!
//! A record is a JSON file `<pid>-<n>.json` in the board folder (`FLOWGATE_BOARD_DIR`, else
//! `/dev/shm/flowgate-board-<uid>`, else the temporary folder's `flowgate-board-<uid>`),
//! written to a temporary name and renamed over the last one, so a reader never sees half a
//! record. A pipeline's publisher is a tick on its control plane: when the pipeline stops
//! the tick is dropped and the record removed. A process killed with SIGKILL leaves its last
//! record behind: readers skip records whose process is gone (and remove them) or that are
//! older than [`STALE_AFTER`]. `FLOWGATE_BOARD=0` turns publishing off.
//!
//! What a record holds is read from the pipeline's own statistics over the last second: the
//! items it delivered per second, the share of the second the consumer (the training loop)
//! waited, the decode workers against the cores it may use (the node CPU budget's, or its
//! share of the node's), the bytes buffered against the memory budget, the bottleneck (the
//! busiest stage per worker while the loop waits; the training step while it does not), and
//! the failures. The rank comes from `torchrun`'s environment (`RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`), the job from `TORCHELASTIC_RUN_ID` or `MASTER_PORT`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::engine::stats::PipelineStats;
use flowgate_tuner::{StageKind, StageStats};

/// How often a pipeline publishes its record.
pub const PUBLISH_EVERY: Duration = Duration::from_secs(1);

/// A record older than this is not shown (its process is stopped, or stuck).
pub const STALE_AFTER: Duration = Duration::from_secs(5);

/// Below this share of a second spent waiting, the training loop is not starved: the
/// bottleneck is its own step, not a stage.
const WAIT_STARVED: f64 = 0.05;

/// One pipeline's record on the board.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    /// The process.
    pub pid: u32,
    /// The program (its executable's name).
    pub program: String,
    /// `RANK`, if set.
    pub rank: Option<u64>,
    /// `LOCAL_RANK`, if set.
    pub local_rank: Option<u64>,
    /// `WORLD_SIZE`, if set.
    pub world_size: Option<u64>,
    /// The job (`TORCHELASTIC_RUN_ID`, else `MASTER_PORT`), if launched by torchrun.
    pub job: Option<String>,
    /// Items delivered per second over the last second (the source's items out).
    pub items_per_s: f64,
    /// The share of the last second the consumer waited for a batch (0..=1).
    pub wait: f64,
    /// Workers of the decode stage (of every pool stage, where none is called `decode`).
    pub decode_workers: usize,
    /// The cores the pipeline may use: the node CPU budget's, or its share of the node.
    pub cores: usize,
    /// Whether `cores` is a node CPU budget shared with other ranks.
    pub node_budget: bool,
    /// Bytes the stages hold now.
    pub bytes: u64,
    /// The memory budget, if it has one.
    pub memory_budget: Option<u64>,
    /// The bottleneck: a stage's name, or `"step"` (the training loop's own step).
    pub bottleneck: String,
    /// Items failed (skipped) so far.
    pub failures: u64,
    /// The epoch being iterated.
    pub epoch: u64,
    /// When the record was written (seconds since the Unix epoch).
    pub updated: f64,
}

/// The board folder (see the module docs).
pub fn dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FLOWGATE_BOARD_DIR") {
        return PathBuf::from(d);
    }
    // The owner of this process's /proc entry is its user (no libc call needed).
    #[cfg(unix)]
    let uid = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").map_or(0, |m| m.uid())
    };
    #[cfg(not(unix))]
    let uid = 0;
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    base.join(format!("flowgate-board-{uid}"))
}

/// Whether publishing is on (`FLOWGATE_BOARD` is not `0`).
pub(crate) fn enabled() -> bool {
    std::env::var("FLOWGATE_BOARD").map_or(true, |v| v != "0")
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn env_u64(k: &str) -> Option<u64> {
    std::env::var(k).ok().and_then(|v| v.trim().parse().ok())
}

/// Publishes one pipeline's record; removes it when dropped.
pub(crate) struct Publisher {
    path: PathBuf,
    last: Option<PipelineStats>,
    cores: usize,
    node_budget: bool,
}

/// Records made by this process so far (their file names' `n`).
static SEQ: AtomicU64 = AtomicU64::new(0);

impl Publisher {
    /// A publisher for a pipeline that may use `cores` (`node_budget`: a node CPU budget's).
    pub(crate) fn new(cores: usize, node_budget: bool) -> Self {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        Self {
            path: dir().join(format!("{}-{n}.json", std::process::id())),
            last: None,
            cores,
            node_budget,
        }
    }

    /// Writes the record from `stats` (compared with the last call's); an error is ignored:
    /// the board is a view, never a reason to stop a pipeline.
    pub(crate) fn publish(&mut self, stats: PipelineStats) {
        let record = self.record(&stats);
        self.last = Some(stats);
        let Ok(text) = serde_json::to_vec(&record) else {
            return;
        };
        let dir = dir();
        if std::fs::create_dir_all(&dir).is_err() {
            return;
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
        }
        let tmp = self.path.with_extension("tmp");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, &self.path);
        }
    }

    fn record(&self, s: &PipelineStats) -> Record {
        let Summary {
            items_per_s,
            wait,
            bottleneck,
        } = summary(s, self.last.as_ref());
        let pools: Vec<_> = s
            .stages
            .iter()
            .filter(|x| x.kind == Some(StageKind::Pool))
            .collect();
        let decode_workers = match s.stage("decode") {
            Some(d) => d.workers,
            None => pools.iter().map(|x| x.workers).sum(),
        };
        Record {
            pid: std::process::id(),
            program: std::env::current_exe()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_default(),
            rank: env_u64("RANK"),
            local_rank: env_u64("LOCAL_RANK"),
            world_size: env_u64("WORLD_SIZE"),
            job: std::env::var("TORCHELASTIC_RUN_ID")
                .or_else(|_| std::env::var("MASTER_PORT"))
                .ok(),
            items_per_s,
            wait,
            decode_workers,
            cores: self.cores,
            node_budget: self.node_budget,
            bytes: s.bytes_held(),
            memory_budget: s.memory_budget.as_ref().map(|m| m.bytes),
            bottleneck,
            failures: s.failures,
            epoch: s.epoch,
            updated: now(),
        }
    }
}

/// A pipeline's pace over a window: what a record shows, and what ranks compare at an
/// epoch's end.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Summary {
    /// Items the source put out per second.
    pub items_per_s: f64,
    /// The share of the window the consumer waited for a batch (0..=1).
    pub wait: f64,
    /// The bottleneck: the busiest stage per worker while the consumer waits, `"step"` (the
    /// training loop's own step) while it does not.
    pub bottleneck: String,
}

/// The pace of the pipeline whose statistics are `now`, over the window since `last` (the
/// same pipeline's earlier statistics), or since its start.
pub fn summary(now: &PipelineStats, last: Option<&PipelineStats>) -> Summary {
    let prev = |name: &str| last.and_then(|l| l.stage(name));
    let secs = |a: Duration, b: Duration| a.saturating_sub(b).as_secs_f64();
    let source = now
        .stages
        .iter()
        .find(|x| x.kind == Some(StageKind::Source));
    let sink = now.stages.iter().find(|x| x.kind == Some(StageKind::Sink));
    let window = sink.map_or(0.0, |k| {
        secs(
            k.elapsed,
            prev(&k.name).map_or(Duration::ZERO, |p| p.elapsed),
        )
    });
    let per_s = |v: f64| if window > 0.0 { v / window } else { 0.0 };
    let items_per_s = source.map_or(0.0, |x| {
        per_s(
            x.items_out
                .saturating_sub(prev(&x.name).map_or(0, |p| p.items_out)) as f64,
        )
    });
    let wait = sink.map_or(0.0, |k| {
        per_s(secs(
            k.blocked_get,
            prev(&k.name).map_or(Duration::ZERO, |p| p.blocked_get),
        ))
        .clamp(0.0, 1.0)
    });
    let bottleneck = if wait < WAIT_STARVED {
        "step".to_owned()
    } else {
        now.stages
            .iter()
            .filter(|x| !matches!(x.kind, Some(StageKind::Source) | Some(StageKind::Sink)))
            .map(|x| (busy_share(x, prev(&x.name), window), &x.name))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map_or_else(|| "source".to_owned(), |(_, n)| n.clone())
    };
    Summary {
        items_per_s,
        wait,
        bottleneck,
    }
}

/// The share of its workers' time stage `now` was busy over a window of `window` seconds
/// since `before` (the same stage's earlier statistics, or its start): of the most workers it
/// had in the window, so a stage shrunk within it does not read over 100%.
pub fn busy_share(now: &StageStats, before: Option<&StageStats>, window: f64) -> f64 {
    if window <= 0.0 {
        return 0.0;
    }
    let (busy, workers) = before.map_or((Duration::ZERO, now.workers), |p| {
        (p.busy, now.workers.max(p.workers))
    });
    now.busy.saturating_sub(busy).as_secs_f64() / (window * workers.max(1) as f64)
}

impl Summary {
    /// What holds the pipeline back, in words: `the training step (the loader keeps up)`, or
    /// `the decode stage`.
    pub fn held_back_by(&self) -> String {
        held_back_by(&self.bottleneck)
    }
}

/// [`Summary::held_back_by`] for a bottleneck's name (`"step"`, a stage's name).
pub fn held_back_by(bottleneck: &str) -> String {
    if bottleneck == "step" {
        "the training step (the loader keeps up)".to_owned()
    } else {
        format!("the {bottleneck} stage")
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether process `pid` is alive.
fn alive(pid: u32) -> bool {
    if !Path::new("/proc/self").exists() {
        return true; // no /proc to ask: the staleness rule alone
    }
    pid > 0 && Path::new("/proc").join(pid.to_string()).exists()
}

/// The board's current records (of live processes, written within [`STALE_AFTER`]), by job
/// and rank; records of processes that are gone are removed.
pub fn read(dir: &Path) -> Vec<Record> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let t = now();
    let mut out: Vec<Record> = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        let Some(r) = std::fs::read(&p)
            .ok()
            .and_then(|b| serde_json::from_slice::<Record>(&b).ok())
        else {
            continue;
        };
        if !alive(r.pid) {
            let _ = std::fs::remove_file(&p);
            continue;
        }
        if t - r.updated > STALE_AFTER.as_secs_f64() {
            continue;
        }
        out.push(r);
    }
    out.sort_by(|a, b| {
        (&a.job, a.rank, a.pid)
            .partial_cmp(&(&b.job, b.rank, b.pid))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    out
}

/// The group a record belongs to: its torchrun job, or without one its own process
/// (`pid N`): loaders of unrelated processes are not one job.
pub fn group(r: &Record) -> String {
    match &r.job {
        Some(job) => job.clone(),
        None => format!("pid {}", r.pid),
    }
}

/// Whether the loader is idle: it delivers nothing and its training loop is not waiting for it
/// (a validation loader between evaluations, an iterator made and left). A stalled loader
/// whose loop waits is not idle.
pub fn idle(r: &Record) -> bool {
    r.items_per_s < IDLE_RATE && r.wait < WAIT_STARVED
}

/// Below this many items a second (and with its loop not waiting) a loader is idle.
pub const IDLE_RATE: f64 = 0.5;

/// The straggler of each job: among its ranks (records with a rank, of one group, not idle),
/// the one delivering the fewest items per second, if it is clearly behind (under
/// [`STRAGGLER_SHARE`] of the job's median). Loaders of one process without ranks (a training
/// and a validation loader) are not ranks of a job, and an idle loader is never a straggler.
/// Returns the indices into `records`.
pub fn stragglers(records: &[Record]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut jobs: Vec<String> = records.iter().map(group).collect();
    jobs.sort();
    jobs.dedup();
    for job in jobs {
        let of: Vec<usize> = (0..records.len())
            .filter(|&i| group(&records[i]) == job)
            .filter(|&i| records[i].rank.is_some() && !idle(&records[i]))
            .collect();
        if of.len() < 2 {
            continue;
        }
        let mut rates: Vec<f64> = of.iter().map(|&i| records[i].items_per_s).collect();
        rates.sort_by(f64::total_cmp);
        let median = rates[rates.len() / 2];
        let slowest = of
            .iter()
            .copied()
            .min_by(|&a, &b| records[a].items_per_s.total_cmp(&records[b].items_per_s))
            .expect("two records");
        if records[slowest].items_per_s < STRAGGLER_SHARE * median {
            out.push(slowest);
        }
    }
    out
}

/// A rank is a straggler when it delivers under this share of its job's median rate.
pub const STRAGGLER_SHARE: f64 = 0.8;

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(pid: u32, rank: u64, rate: f64) -> Record {
        Record {
            pid,
            program: "t".into(),
            rank: Some(rank),
            local_rank: Some(rank),
            world_size: Some(3),
            job: Some("j".into()),
            items_per_s: rate,
            wait: 0.5,
            decode_workers: 1,
            cores: 1,
            node_budget: false,
            bytes: 0,
            memory_budget: None,
            bottleneck: "decode".into(),
            failures: 0,
            epoch: 0,
            updated: now(),
        }
    }

    fn stage(name: &str, kind: StageKind, workers: usize, busy_s: f64, out: u64) -> StageStats {
        StageStats {
            name: name.into(),
            kind: Some(kind),
            workers,
            busy: Duration::from_secs_f64(busy_s),
            items_out: out,
            elapsed: Duration::from_secs(10),
            ..StageStats::default()
        }
    }

    #[test]
    fn a_stage_shrunk_within_the_window_is_busy_of_its_most_workers() {
        // 4 workers at the window's start, 1 at its end: 2.5 busy-seconds in a 2-second
        // window are a share of 4 workers' 8 seconds, not of 1 worker's 2 (125%).
        let before = stage("decode", StageKind::Pool, 4, 10.0, 0);
        let now = stage("decode", StageKind::Pool, 1, 12.5, 100);
        let share = busy_share(&now, Some(&before), 2.0);
        assert!((share - 2.5 / 8.0).abs() < 1e-9, "{share}");
        assert!(busy_share(&now, None, 20.0) <= 1.0);
        assert_eq!(busy_share(&now, Some(&before), 0.0), 0.0);
    }

    #[test]
    fn the_bottleneck_is_the_busiest_stage_while_the_loop_waits_and_says_so_in_words() {
        let mut sink = stage("sink", StageKind::Sink, 1, 0.0, 50);
        let mut stats = PipelineStats {
            stages: vec![
                stage("source", StageKind::Source, 1, 1.0, 400),
                stage("decode", StageKind::Pool, 2, 18.0, 400),
                stage("collate", StageKind::Serial, 1, 2.0, 50),
                sink.clone(),
            ],
            ..PipelineStats::default()
        };
        let p = summary(&stats, None);
        assert_eq!((p.bottleneck.as_str(), p.items_per_s), ("step", 40.0));
        assert_eq!(p.held_back_by(), "the training step (the loader keeps up)");
        sink.blocked_get = Duration::from_secs(5);
        *stats.stages.last_mut().unwrap() = sink;
        let p = summary(&stats, None);
        assert_eq!((p.bottleneck.as_str(), p.wait), ("decode", 0.5));
        assert_eq!(p.held_back_by(), "the decode stage");
    }

    #[test]
    fn the_slowest_rank_clearly_behind_is_the_straggler() {
        let r = vec![rec(1, 0, 100.0), rec(2, 1, 40.0), rec(3, 2, 95.0)];
        assert_eq!(stragglers(&r), [1]);
        let even = vec![rec(1, 0, 100.0), rec(2, 1, 90.0), rec(3, 2, 95.0)];
        assert!(stragglers(&even).is_empty());
        assert!(stragglers(&r[..1]).is_empty(), "one rank: no straggler");
    }

    #[test]
    fn records_of_gone_processes_are_removed_and_stale_ones_skipped() {
        let d = std::env::temp_dir().join(format!("flowgate-board-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let me = std::process::id();
        let write = |name: &str, r: &Record| {
            std::fs::write(d.join(name), serde_json::to_vec(r).unwrap()).unwrap();
        };
        write("live.json", &rec(me, 0, 1.0));
        let mut old = rec(me, 1, 1.0);
        old.updated -= 60.0;
        write("old.json", &old);
        // A pid far past any real one.
        write("gone.json", &rec(1 << 30, 2, 1.0));
        std::fs::write(d.join("half.json"), b"{\"pid\":").unwrap();
        let got = read(&d);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].rank, Some(0));
        assert!(!d.join("gone.json").exists());
        let _ = std::fs::remove_dir_all(&d);
    }
}
