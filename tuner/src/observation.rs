//! What a policy sees each tick, what it may do, and the budgets it must respect.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{CacheStats, StageKind};

/// One stage over the last tick window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageObservation {
    /// The stage's name.
    pub name: String,
    /// Its kind (a sink is the consumer's buffer).
    pub kind: Option<StageKind>,
    /// Active workers (pool), concurrency (async), 1 otherwise.
    pub workers: usize,
    /// Most workers the stage may run.
    pub max_workers: usize,
    /// The user fixed `workers`: never change it.
    pub workers_pinned: bool,
    /// The user fixed the budget: never change it.
    pub budget_pinned: bool,
    /// Items the stage finished in the window.
    pub items: u64,
    /// Items it sent on in the window.
    pub items_out: u64,
    /// Worker time in the user's function in the window (all workers together).
    pub busy: Duration,
    /// Worker time blocked waiting for room downstream in the window.
    pub blocked_put: Duration,
    /// Worker time blocked waiting for input in the window.
    pub blocked_get: Duration,
    /// Items held now.
    pub queue_items: usize,
    /// Bytes held now.
    pub queue_bytes: u64,
    /// Item budget now.
    pub budget_items: usize,
    /// Byte budget now.
    pub budget_bytes: u64,
    /// Typical bytes of one item the stage holds (0 if unknown).
    pub item_bytes: u64,
    /// Coefficient of variation (standard deviation / mean) of the time per item, over the
    /// stage's life: 0 for constant work, around 1 for exponential, more for heavy tails.
    pub cost_cv: f64,
    /// The stage's cache: capacity and size now, hits, misses and evictions in the window.
    pub cache: Option<CacheStats>,
    /// The stage's read-ahead: its depth now, reads and waits in the window.
    pub read_ahead: Option<crate::ReadAheadStats>,
    /// Threads per item, if the stage's work has that knob.
    pub item_threads: Option<crate::ItemThreadsStats>,
}

impl StageObservation {
    /// Whether the stage runs on CPU cores (pool, serial) rather than waiting on I/O.
    pub fn is_cpu(&self) -> bool {
        matches!(self.kind, Some(StageKind::Pool) | Some(StageKind::Serial))
    }

    /// Whether the tuner may resize the stage.
    pub fn resizable(&self) -> bool {
        !self.workers_pinned && matches!(self.kind, Some(StageKind::Pool) | Some(StageKind::Async))
    }
}

/// Hard limits no action may exceed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budgets {
    /// Bytes the pipeline's buffers may hold in total.
    pub memory_bytes: u64,
    /// Cores the CPU stages may use.
    pub cores: usize,
}

impl Budgets {
    /// Half of the memory available to this process now (see [`available_memory`]) and the
    /// number of cores.
    ///
    /// On a node shared by `LOCAL_WORLD_SIZE` ranks (`torchrun`), each rank gets its share of
    /// the cores and of the memory budget, so ranks sizing themselves independently never
    /// oversubscribe the node together.
    pub fn detect() -> Self {
        Self::detect_with_source().0
    }

    /// [`detect`](Self::detect), and where the memory budget came from, in words (what
    /// statistics and the command's summary show).
    pub fn detect_with_source() -> (Self, String) {
        let available = available_memory();
        let ranks = local_ranks(std::env::var("LOCAL_WORLD_SIZE").ok().as_deref());
        let budgets = Self {
            memory_bytes: available.bytes / 2 / ranks as u64,
            cores: node_share(machine_cores(), ranks),
        };
        let share = if ranks > 1 {
            format!(", shared by {ranks} ranks (LOCAL_WORLD_SIZE)")
        } else {
            String::new()
        };
        (
            budgets,
            format!("the default: half of {}{share}", available.source),
        )
    }
}

/// Memory this process may still take, and where the figure came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AvailableMemory {
    /// Bytes.
    pub bytes: u64,
    /// Where they came from, in words (`"the cgroup's memory.max (400.0 MiB) less the
    /// 52.1 MiB this process holds"`).
    pub source: String,
}

/// The memory available to this process: the host's `MemAvailable`, or less when the process
/// runs in a cgroup with a memory limit (a container, a Kubernetes pod, a Slurm job): the
/// tightest limit of its cgroup and the cgroups above it (v2 `memory.max`, v1
/// `memory.limit_in_bytes`) less what the process holds already (its RSS). 8 GiB when nothing
/// can be read.
pub fn available_memory() -> AvailableMemory {
    let host = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| meminfo_available(&m));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_limit(std::path::Path::new("/sys/fs/cgroup"), &c));
    let rss = process_rss().unwrap_or(0);
    combine(host, cgroup, rss)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / 1048576.0)
}

/// The figure from the host's and the cgroup's (`(limit, what)`), `rss` held already.
fn combine(host: Option<u64>, cgroup: Option<(u64, String)>, rss: u64) -> AvailableMemory {
    let host_said = |b: u64| format!("the host's MemAvailable ({})", mib(b));
    if let Some((limit, what)) = cgroup {
        let left = limit.saturating_sub(rss);
        if host.is_none_or(|h| left < h) {
            return AvailableMemory {
                bytes: left,
                source: format!(
                    "the cgroup's {what} ({}) less the {} this process holds",
                    mib(limit),
                    mib(rss)
                ),
            };
        }
    }
    match host {
        Some(h) => AvailableMemory {
            bytes: h,
            source: host_said(h),
        },
        None => AvailableMemory {
            bytes: 8 << 30,
            source: "8 GiB (no memory figure could be read)".into(),
        },
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn meminfo_available(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// The resident memory of this process (`/proc/self/statm`), in bytes.
fn process_rss() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// A v1 limit this large means none (the kernel's "unlimited", rounded to a page).
const V1_UNLIMITED: u64 = 1 << 62;

/// The tightest memory limit of the cgroup that `proc_cgroup` (a `/proc/self/cgroup` text)
/// names, and of those above it, under the cgroup file systems mounted at `root`: v2's
/// `memory.max` (the `0::PATH` line), else v1's `memory.limit_in_bytes` (the `memory`
/// controller's line). A path that is not there under `root` (a cgroup namespace shows the
/// container's own cgroup as `/`) is read from the mount's top. `None` without a limit.
pub fn cgroup_limit(root: &std::path::Path, proc_cgroup: &str) -> Option<(u64, String)> {
    let mut v2 = None;
    let mut v1 = None;
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.is_empty() {
            v2 = Some(path.to_owned());
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_owned());
        }
    }
    let tightest = |base: std::path::PathBuf, path: &str, file: &str| -> Option<u64> {
        let rel = path.trim_start_matches('/');
        let start = if base.join(rel).is_dir() {
            base.join(rel)
        } else {
            base.clone()
        };
        let mut dir = start.as_path();
        let mut best: Option<u64> = None;
        loop {
            if let Ok(text) = std::fs::read_to_string(dir.join(file)) {
                if let Ok(v) = text.trim().parse::<u64>() {
                    if v < V1_UNLIMITED {
                        best = Some(best.map_or(v, |b| b.min(v)));
                    }
                }
            }
            if dir == base {
                break;
            }
            match dir.parent() {
                Some(p) if p.starts_with(&base) => dir = p,
                _ => break,
            }
        }
        best
    };
    if let Some(path) = &v2 {
        // v2's "max" is no limit (it does not parse as a number).
        if let Some(v) = tightest(root.to_path_buf(), path, "memory.max") {
            return Some((v, "memory.max".into()));
        }
        if let Some(v) = tightest(root.join("unified"), path, "memory.max") {
            return Some((v, "memory.max".into()));
        }
    }
    if let Some(path) = &v1 {
        if let Some(v) = tightest(root.join("memory"), path, "memory.limit_in_bytes") {
            return Some((v, "memory.limit_in_bytes".into()));
        }
    }
    None
}

/// The cores this machine offers the process (its affinity mask or quota).
pub fn machine_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How many processes share this node: `LOCAL_WORLD_SIZE` (what `torchrun` sets for the ranks
/// on one node), 1 when it is absent or not a positive number.
pub fn local_ranks(local_world_size: Option<&str>) -> usize {
    local_world_size
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

/// One rank's share of `cores` when `ranks` processes share the node (at least one): so that
/// ranks sizing themselves independently never oversubscribe the node together.
pub fn node_share(cores: usize, ranks: usize) -> usize {
    (cores / ranks.max(1)).max(1)
}

/// The cores this process may use: its share of the node's (see [`Budgets::detect`]).
pub fn process_cores() -> usize {
    node_share(
        machine_cores(),
        local_ranks(std::env::var("LOCAL_WORLD_SIZE").ok().as_deref()),
    )
}

/// Everything a policy sees at one tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// Time since the pipeline (or simulation) started.
    pub now: Duration,
    /// Length of the window the counters cover.
    pub window: Duration,
    /// Every stage but the source, in pipeline order; the last is the sink (the consumer's
    /// buffer), whose `blocked_get` is the consumer's wait.
    pub stages: Vec<StageObservation>,
    /// Results the consumer took in the window.
    pub delivered: u64,
    /// Time the consumer waited for results in the window: the direct measure of starvation.
    pub consumer_wait: Duration,
    /// Accelerator utilisation (0..=1) when known.
    pub gpu_util: Option<f64>,
    /// Bytes held in all buffers now.
    pub buffered_bytes: u64,
    /// Resident memory of the process, when known.
    pub rss_bytes: Option<u64>,
    /// The limits.
    pub budgets: Option<Budgets>,
    /// The epoch the pipeline runs, when known: a consumer waits at an epoch's start whatever
    /// the buffers hold (nothing of it could be made earlier), which a policy may discount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
}

impl Observation {
    /// Results per second in the window.
    pub fn rate(&self) -> f64 {
        self.delivered as f64 / self.window.as_secs_f64().max(1e-9)
    }

    /// Fraction of the window the consumer waited.
    pub fn wait_fraction(&self) -> f64 {
        (self.consumer_wait.as_secs_f64() / self.window.as_secs_f64().max(1e-9)).min(1.0)
    }

    /// How starved the accelerator is, 0..=1: the consumer's wait fraction, capped by the
    /// accelerator's idle fraction when its utilisation is known (a training loop that waits
    /// for data while the GPU still runs queued work is not starving it).
    pub fn starvation(&self) -> f64 {
        let wait = self.wait_fraction();
        match self.gpu_util {
            Some(u) => wait.min(1.0 - u.clamp(0.0, 1.0)),
            None => wait,
        }
    }
}

/// A change to one knob of one stage (indexes into [`Observation::stages`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Set the active workers (concurrency for async stages).
    SetWorkers {
        /// Stage index.
        stage: usize,
        /// Workers wanted.
        workers: usize,
    },
    /// Set how many items and bytes the stage may hold (its prefetch buffer).
    SetPrefetch {
        /// Stage index.
        stage: usize,
        /// Item budget.
        items: usize,
        /// Byte budget.
        bytes: u64,
    },
    /// Set the byte budget of a cache stage.
    SetCacheBytes {
        /// Stage index.
        stage: usize,
        /// Byte budget.
        bytes: u64,
    },
    /// Set how many objects a stage's read-ahead fetches ahead of the readers.
    SetReadAhead {
        /// Stage index.
        stage: usize,
        /// Objects in flight ahead.
        depth: usize,
    },
    /// Set how many threads each item a stage starts from now on may use (a video decoder's
    /// frame threads).
    SetItemThreads {
        /// Stage index.
        stage: usize,
        /// Threads per item.
        threads: usize,
    },
}

impl Action {
    /// The action in words, as the `flowgate` command's decision lines and Python's
    /// `tuner_trace()` say it: `decode → 3 workers`, `decode queue → 8 items, at most 64.0
    /// MiB`. `stages` names the stages (a trace record's); a byte budget at or past
    /// `memory_budget` (the whole pipeline's) is not shown as the queue's own.
    pub fn describe(&self, stages: &[String], memory_budget: u64) -> String {
        let name = |i: usize| stages.get(i).map_or("?", String::as_str);
        let count = |n: usize, one: &str| match n {
            1 => format!("1 {one}"),
            n => format!("{n} {one}s"),
        };
        match *self {
            Action::SetWorkers { stage, workers } => {
                format!("{} → {}", name(stage), count(workers, "worker"))
            }
            Action::SetPrefetch {
                stage,
                items,
                bytes,
            } => {
                let queue = format!("{} queue → {}", name(stage), count(items, "item"));
                if bytes == u64::MAX || bytes >= memory_budget {
                    queue
                } else {
                    format!("{queue}, at most {}", bytes_in_words(bytes))
                }
            }
            Action::SetCacheBytes { stage, bytes } => {
                format!("{} cache → {}", name(stage), bytes_in_words(bytes))
            }
            Action::SetReadAhead { stage, depth } => {
                format!("{} read-ahead → {}", name(stage), count(depth, "shard"))
            }
            Action::SetItemThreads { stage, threads } => {
                format!("{} → {} per item", name(stage), count(threads, "thread"))
            }
        }
    }
}

/// A byte count as people read it: `512 B`, `1.5 KiB`, `3.7 GiB`.
pub fn bytes_in_words(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// An action and why it was taken (recorded in the decision trace).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// What to change.
    pub action: Action,
    /// Why, in a short sentence.
    pub reason: String,
}

/// A scheduling policy: looks at each tick's observation and decides what to change.
///
/// Policies are pure and deterministic given their inputs, so the same code runs in the
/// [`Simulator`](crate::sim::Simulator) (thousands of simulated seconds per real second) and on
/// a real pipeline (driven by the tuner actor). Rules a policy must follow, which the tuner
/// also enforces: never change a pinned knob, keep at least one worker per stage, and keep the
/// sum of buffer budgets within [`Budgets::memory_bytes`].
pub trait Policy: Send {
    /// A short name for traces.
    fn name(&self) -> &str;
    /// Decides the changes for this tick (often none).
    fn decide(&mut self, obs: &Observation) -> Vec<Decision>;
    /// The consumer came back after a pause during which the policy was not asked (see
    /// [`Park`](crate::policy::Park)): rates and trials from before it say nothing of now.
    fn resumed(&mut self) {}
}

impl<P: Policy + ?Sized> Policy for Box<P> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn decide(&mut self, obs: &Observation) -> Vec<Decision> {
        (**self).decide(obs)
    }
    fn resumed(&mut self) {
        (**self).resumed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/sys/fs/cgroup` with `files` (path, contents) under a fresh folder.
    fn fake(name: &str, files: &[(&str, &str)]) -> std::path::PathBuf {
        let root =
            std::env::temp_dir().join(format!("flowgate-cgroup-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        root
    }

    #[test]
    fn a_cgroups_memory_limit_is_the_tightest_of_it_and_those_above() {
        // v2: the job's cgroup has no limit of its own, its parent has 400 MiB.
        let v2 = fake(
            "v2",
            &[
                ("memory.max", "max\n"),
                ("kubepods/memory.max", "419430400\n"),
                ("kubepods/pod1/memory.max", "max\n"),
            ],
        );
        let got = cgroup_limit(&v2, "0::/kubepods/pod1\n");
        assert_eq!(got, Some((419_430_400, "memory.max".into())));
        // No limit anywhere: none.
        let free = fake(
            "v2free",
            &[("memory.max", "max\n"), ("a/memory.max", "max\n")],
        );
        assert_eq!(cgroup_limit(&free, "0::/a\n"), None);
        // v1: the memory controller's line; the kernel's "unlimited" is none.
        let v1 = fake(
            "v1",
            &[
                ("memory/memory.limit_in_bytes", "9223372036854771712\n"),
                ("memory/job/memory.limit_in_bytes", "1073741824\n"),
            ],
        );
        let text = "4:memory:/job\n3:cpu,cpuacct:/job\n0::/\n";
        assert_eq!(
            cgroup_limit(&v1, text),
            Some((1 << 30, "memory.limit_in_bytes".into()))
        );
        // A cgroup namespace names its own cgroup "/": read at the mount's top.
        let ns = fake("ns", &[("memory.max", "268435456\n")]);
        assert_eq!(cgroup_limit(&ns, "0::/\n").map(|l| l.0), Some(256 << 20));
        for d in [v2, free, v1, ns] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn the_available_memory_is_the_limit_less_what_the_process_holds_when_tighter() {
        let mib = 1u64 << 20;
        let a = combine(
            Some(20_000 * mib),
            Some((400 * mib, "memory.max".into())),
            50 * mib,
        );
        assert_eq!(a.bytes, 350 * mib);
        assert!(
            a.source
                .contains("memory.max (400.0 MiB) less the 50.0 MiB"),
            "{}",
            a.source
        );
        // A host with less free than the cgroup allows: the host's figure.
        let b = combine(
            Some(100 * mib),
            Some((400 * mib, "memory.max".into())),
            50 * mib,
        );
        assert_eq!(b.bytes, 100 * mib);
        assert!(b.source.contains("MemAvailable"), "{}", b.source);
        assert_eq!(combine(None, None, 0).bytes, 8 << 30);
        assert_eq!(
            meminfo_available("MemTotal: 10 kB\nMemAvailable:  2048 kB\n"),
            Some(2 << 20)
        );
    }

    #[test]
    fn ranks_on_one_node_share_its_cores() {
        assert_eq!(local_ranks(None), 1);
        assert_eq!(local_ranks(Some("8")), 8);
        assert_eq!(local_ranks(Some("0")), 1);
        assert_eq!(local_ranks(Some("x")), 1);
        assert_eq!(node_share(32, 8), 4);
        assert_eq!(node_share(2, 2), 1);
        assert_eq!(node_share(2, 4), 1, "at least one each");
        // Eight ranks sizing for their share never ask for more than the node has.
        assert!(8 * node_share(32, 8) <= 32);
    }
}
